#!/usr/bin/env bash
# Pretrain a GPT-family model with megatron-core. With no arguments: builds the offline demo corpus and
# tokenizer (pretrain_scripts/prepare_demo_data.sh) and trains a tiny GPT for 300 iterations on the GPU
# if there is one, else on the CPU (gloo). Every setting is an environment variable with a default;
# any extra argument is passed to pretrain_megatron_gpt.py (see its --help) after the launcher's own
# flags, so it wins over them, e.g.
#   TP=2 PP=2 GPUS=8 MODEL_SIZE=1.3b bash pretrain_scripts/run_gpt.sh --bf16 --train-iters 1000
# MEMORY=one-gpu adds the flags that fit the largest model on one GPU (see below).
# --plan prints the parallel-layout planner's prediction for these flags on GPUS x NNODES GPUs (memory per rank,
# step time, and whether it fits a PLAN_GPU: h100-80gb by default, h200, a100-80gb, a100-40gb) and exits.
# Multi-node: the same command on every node with NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT set.
#
# Defaults that depend on other settings (global batch, warmup, save interval, max positions) are not
# computed here, where a later flag could contradict them, but in Python from the final flags.
# Before torchrun starts, the whole configuration and the data are checked once for GPUS x NNODES
# processes (pretrain_megatron_gpt.py --validate-only): a mistake is one `configuration error: ...`
# line and exit status 2 (a --save directory that holds another run's checkpoints included: resume them with
# --load, or set OUTPUT). With --validate-only among the arguments, the launcher stops after that check.
# Everything the job prints also goes to OUTPUT/logs/run_gpt_<date>_<time>.log (the path is printed first).
# The settings shared with run_bert.sh (GPUS, TP, PP, ZERO, SEQ_LEN, MBS, GBS, TRAIN_ITERS, LR, MIN_LR,
# WARMUP, LOG_INTERVAL, EVAL_INTERVAL, SAVE_INTERVAL, PRECISION, NNODES, ...) are in launcher.sh.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PLAN=0
KEEP=()
for arg in "$@"; do
  if [ "$arg" = --plan ]; then PLAN=1; else KEEP+=("$arg"); fi
done
set -- ${KEEP[@]+"${KEEP[@]}"}
EXTRA=("$@")
source "$ROOT/pretrain_scripts/launcher.sh"

MODEL_FAMILY=${MODEL_FAMILY:-gpt}        # gpt | llama | llama3 | qwen2 | qwen3 | mistral | mixtral | qwen2_moe | qwen3_moe | deepseek_v2
MODEL_SIZE=${MODEL_SIZE:-tiny}           # tiny | 125m | 350m | 1.3b | ... (see --help)
HF_MODEL=${HF_MODEL:-}                   # a Hugging Face model directory to start from (instead of MODEL_FAMILY/SIZE)
# Where the run writes (checkpoints in OUTPUT/checkpoints, metrics, tensorboard, logs). A --save directory that
# holds another run's checkpoints is refused before launch; resuming with --load DIR/checkpoints of a launcher
# run writes back into DIR (the run continues in place), starting from another checkpoint names OUTPUT after it.
# Without OUTPUT, a default directory that holds an earlier run's checkpoints gets a suffix (_2, _3, ...).
LOAD=$(flag_value --load)
if [ -z "${OUTPUT:-}" ]; then
  if [ -n "$HF_MODEL" ]; then
    OUTPUT=$(fresh_output "$ROOT/work_dirs/$(basename "$HF_MODEL")")
  elif [ -n "$LOAD" ] && [ "$(basename "$LOAD")" = checkpoints ]; then
    OUTPUT=$(dirname "$LOAD")
  elif [ -n "$LOAD" ]; then
    OUTPUT=$(fresh_output "$ROOT/work_dirs/$(basename "$LOAD")")
  else
    OUTPUT=$(fresh_output "$ROOT/work_dirs/${MODEL_FAMILY}_${MODEL_SIZE}")
  fi
fi
SAVE=${SAVE:-$OUTPUT/checkpoints}

if [ -n "${HF_MODEL:-}" ]; then  # a Hugging Face model: architecture and weights from it
  ARGS=(--load-hf "$HF_MODEL")
elif [ -f "$LOAD/latest_checkpointed_iteration.txt" ]; then
  ARGS=()  # resuming, or starting from a converted checkpoint: the architecture is stored there
else
  ARGS=(--model-family "$MODEL_FAMILY" --model-size "$MODEL_SIZE")
fi
common_args
ARGS+=(--weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95)
# MEMORY=one-gpu: the largest model one GPU trains whole (not LoRA), e.g. MODEL_FAMILY=llama3 MODEL_SIZE=8b on a
# 141 GB H200: bf16 gradients, Adam's moments in bf16 through the fused kernel, every layer recomputed, the loss
# through the output layer in chunks (no logits), layers compiled. About 12 bytes per parameter of model state.
case "${MEMORY:-}" in
  "") ;;
  one-gpu) ARGS+=(--bf16 --grad-reduce-in-bf16 --optimizer-step-fusion --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16
                  --checkpoint-activations --recompute-granularity full --recompute-method uniform
                  --recompute-num-layers 1 --cross-entropy-loss-fusion --cross-entropy-fusion-impl linear
                  --gradient-accumulation-fusion --compile) ;;
  *) echo "configuration error: MEMORY=$MEMORY: the preset is one-gpu (or leave MEMORY unset)" >&2; exit 2 ;;
esac
if [ "$PLAN" = 1 ]; then  # the planner reads the model and layout flags; no data is needed
  exec "$PY" "$ROOT/tools/plan_parallel.py" --gpus $((GPUS * NNODES)) --gpu "${PLAN_GPU:-h100-80gb}" \
    --engine-flags "$(printf '%q ' "${ARGS[@]}" "$@" --mock-data)"
fi
if [ -n "${DATA_PATH:-}" ]; then
  # DATA_PATH may be "prefix" or "w1 prefix1 w2 prefix2"; give the tokenizer through TOKENIZER_ARGS.
  read -r -a DATA_ARGS <<< "$DATA_PATH"
  read -r -a TOKENIZER_ARGS <<< "${TOKENIZER_ARGS:-}"
  ARGS+=(--data-path "${DATA_ARGS[@]}" "${TOKENIZER_ARGS[@]}")
elif [ -n "${HF_MODEL:-}" ] && ! given --data-path --mock-data; then
  # The demo corpus tokenized with the model's own tokenizer (its ids must fit the model's vocabulary).
  DATA_PATH=$(HF_TOKENIZER=$HF_MODEL bash "$ROOT/pretrain_scripts/prepare_demo_data.sh" | tail -n 1)
  ARGS+=(--data-path "$DATA_PATH" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_MODEL")
elif ! given --data-path --mock-data; then
  DATA_PATH=$(bash "$ROOT/pretrain_scripts/prepare_demo_data.sh" | tail -n 1)
  DEMO_DIR=$(dirname "$DATA_PATH")
  ARGS+=(--data-path "$DATA_PATH" --tokenizer-type GPT2BPETokenizer --vocab-file "$DEMO_DIR/gpt2-vocab.json"
         --merge-file "$DEMO_DIR/gpt2-merges.txt")
fi
ARGS+=("$@")
launch "$ROOT/pretrain_megatron_gpt.py"
