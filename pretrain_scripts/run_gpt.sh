#!/usr/bin/env bash
# Pretrain a GPT-family model with megatron-core. With no arguments: builds the offline demo corpus and
# tokenizer (pretrain_scripts/prepare_demo_data.sh) and trains a tiny GPT for 300 iterations on the GPU
# if there is one, else on the CPU (gloo). Every setting is an environment variable with a default;
# any extra argument is passed to pretrain_megatron_gpt.py (see its --help) after the launcher's own
# flags, so it wins over them, e.g.
#   TP=2 PP=2 GPUS=8 MODEL_SIZE=1.3b bash pretrain_scripts/run_gpt.sh --bf16 --train-iters 1000
# Multi-node: the same command on every node with NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT set.
#
# Defaults that depend on other settings (global batch, warmup, save interval, max positions) are not
# computed here, where a later flag could contradict them, but in Python from the final flags.
# Before torchrun starts, the whole configuration and the data are checked once for GPUS x NNODES
# processes (pretrain_megatron_gpt.py --validate-only): a mistake is one `configuration error: ...`
# line and exit status 2. With --validate-only among the arguments, the launcher stops after that check.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/pretrain_scripts/resolve_python.sh"  # PY: $PY, else .venv, else python3; PYTHONUNBUFFERED=1

# given FLAG...: true when an extra argument is one of the flags (as --flag or --flag=value).
given() {
  local arg flag
  for arg in "${EXTRA[@]}"; do
    for flag in "$@"; do
      [[ $arg == "$flag" || $arg == "$flag="* ]] && return 0
    done
  done
  return 1
}
EXTRA=("$@")
# flag_value FLAG: the value an extra argument gives FLAG (--flag value or --flag=value), else empty.
flag_value() {
  local i
  for ((i = 0; i < ${#EXTRA[@]}; i++)); do
    [[ ${EXTRA[i]} == "$1="* ]] && { echo "${EXTRA[i]#*=}"; return; }
    [[ ${EXTRA[i]} == "$1" ]] && { echo "${EXTRA[i + 1]:-}"; return; }
  done
}

HAS_GPU=0
# Importing torch takes seconds: ask it only where a GPU driver is present (NVIDIA, or ROCm's /dev/kfd).
if command -v nvidia-smi >/dev/null 2>&1 || [ -e /dev/nvidiactl ] || [ -e /dev/kfd ]; then
  HAS_GPU=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
fi
if [ "$HAS_GPU" = 1 ]; then
  DEFAULT_GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
  DEFAULT_PRECISION=bf16
else
  DEFAULT_GPUS=1
  DEFAULT_PRECISION=fp32
fi

MODEL_FAMILY=${MODEL_FAMILY:-gpt}        # gpt | llama | qwen2 | mistral | mixtral | qwen2_moe
MODEL_SIZE=${MODEL_SIZE:-tiny}           # tiny | 125m | 350m | 1.3b | ... (see --help)
HF_MODEL=${HF_MODEL:-}                   # a Hugging Face model directory to start from (instead of MODEL_FAMILY/SIZE)
GPUS=${GPUS:-$DEFAULT_GPUS}              # processes per node (one per GPU; CPU processes without GPUs)
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
TP=${TP:-1}
PP=${PP:-1}
ZERO=${ZERO:-0}                          # 0 | 1 (distributed optimizer) | 2 (Megatron-FSDP, grads sharded too)
SEQ_LEN=${SEQ_LEN:-128}
MBS=${MBS:-8}
GBS=${GBS:-}                             # default: MBS x data-parallel size (no accumulation)
TRAIN_ITERS=${TRAIN_ITERS:-300}
LR=${LR:-1e-3}
MIN_LR=${MIN_LR:-1e-4}
WARMUP=${WARMUP:-}                       # iterations; default: 1/15 of the final --train-iters (--lr-decay-iters)
WARMUP_FRACTION=0.0667
LOG_INTERVAL=${LOG_INTERVAL:-20}
EVAL_INTERVAL=${EVAL_INTERVAL:-100}
OUTPUT=${OUTPUT:-$ROOT/work_dirs/$([ -n "$HF_MODEL" ] && basename "$HF_MODEL" || echo "${MODEL_FAMILY}_${MODEL_SIZE}")}
SAVE=${SAVE:-$OUTPUT/checkpoints}
SAVE_INTERVAL=${SAVE_INTERVAL:-}         # default: one checkpoint, when training ends

if [ -n "${HF_MODEL:-}" ]; then  # a Hugging Face model: architecture and weights from it
  ARGS=(--load-hf "$HF_MODEL")
elif [ -f "$(flag_value --load)/latest_checkpointed_iteration.txt" ]; then
  ARGS=()  # resuming, or starting from a converted checkpoint: the architecture is stored there
else
  ARGS=(--model-family "$MODEL_FAMILY" --model-size "$MODEL_SIZE")
fi
ARGS+=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
      --seq-length "$SEQ_LEN" --micro-batch-size "$MBS" --train-iters "$TRAIN_ITERS"
      --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine
      --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 --split 969,30,1
      --data-cache-path "$OUTPUT/index_cache"
      --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters 10
      --save "$SAVE" --tensorboard-dir "$OUTPUT/tensorboard" --metrics-file "$OUTPUT/metrics.jsonl")
[ -z "$GBS" ] || ARGS+=(--global-batch-size "$GBS")
[ -z "$SAVE_INTERVAL" ] || ARGS+=(--save-interval "$SAVE_INTERVAL")
# Switch-like defaults are left out when an extra flag makes the same choice, so the user's flag wins
# instead of contradicting the launcher's (a warmup fraction and --lr-warmup-iters; bf16 and --fp16).
if [ -n "$WARMUP" ]; then
  ARGS+=(--lr-warmup-iters "$WARMUP")
elif ! given --lr-warmup-iters --lr-warmup-fraction; then
  ARGS+=(--lr-warmup-fraction "$WARMUP_FRACTION")  # resolved in Python against the final iteration counts
fi
if [ -n "${PRECISION:-}" ] || ! given --bf16 --fp16 --mixed-precision; then
  PRECISION=${PRECISION:-$DEFAULT_PRECISION}
  case "$PRECISION" in
    bf16) ARGS+=(--bf16) ;;
    fp16) ARGS+=(--fp16) ;;
    fp32) ;;
    *) echo "configuration error: PRECISION=$PRECISION: choose fp32, bf16 or fp16" >&2; exit 2 ;;
  esac
fi
case "$ZERO" in
  0) ;;
  1|2) ARGS+=(--zero-$ZERO-memory-optimization) ;;
  *) echo "configuration error: ZERO=$ZERO: choose 0, 1 or 2" >&2; exit 2 ;;
esac
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

mkdir -p "$OUTPUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$([ "$HAS_GPU" = 1 ] && echo 8 || echo 1)}
# One check for the whole job, here, before any worker starts: exits 2 with the reason on a mistake.
env -u RANK -u LOCAL_RANK WORLD_SIZE=$((GPUS * NNODES)) "$PY" "$ROOT/pretrain_megatron_gpt.py" "${ARGS[@]}" \
  --validate-only >&2
echo "run_gpt.sh: ${NNODES} node(s) x ${GPUS} process(es), log in $OUTPUT" >&2
given --validate-only && exit 0
exec "$PY" -m torch.distributed.run --nproc-per-node "$GPUS" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  "$ROOT/pretrain_megatron_gpt.py" "${ARGS[@]}"
