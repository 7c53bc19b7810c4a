#!/usr/bin/env bash
# Supervised fine-tuning with megatron-core: loss on the assistant turns only (per token over the global batch),
# conversations packed into --seq-length samples, validation on a held-out split, checkpoints, and at the end the
# model exported to Hugging Face format (tools/convert_checkpoint.py mcore2hf, which verifies the logits).
#
# With no arguments: builds the offline demo (pretrain_scripts/prepare_sft_demo.sh: a chat set, a tiny Qwen3 model
# with random weights and its tokenizer) and fine-tunes it, on the GPU if there is one, else on the CPU, in a few
# minutes; the validation loss falls. Your own model and data:
#   HF_MODEL=/path/to/hf_model CHATS=chats.jsonl bash pretrain_scripts/run_sft.sh
#     (CHATS rendered with the model's chat template into data/sft_demo/; or DATA_PATH=PREFIX_text_document made by
#     tools/preprocess_data.py --sft), or Megatron-LM-style flags: --load-hf DIR or --load CHECKPOINT_DIR,
#     --data-path, --tokenizer-model, --no-pack-sequences, ... Extra arguments go to pretrain_megatron_gpt.py after
#     the launcher's own, so they win.
# Settings (environment, with defaults): the launcher's (GPUS, TP, PP, ZERO, SEQ_LEN=256, MBS=4, GBS=16,
# TRAIN_ITERS=200, LR=1e-3, ...: launcher.sh), OUTPUT (default work_dirs/sft_<model>), EXPORT_HF=1 (0: no export).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
EXTRA=("$@")
SEQ_LEN=${SEQ_LEN:-256}
MBS=${MBS:-4}
GBS=${GBS:-16}
TRAIN_ITERS=${TRAIN_ITERS:-200}
EVAL_INTERVAL=${EVAL_INTERVAL:-50}
LOG_INTERVAL=${LOG_INTERVAL:-10}
source "$ROOT/pretrain_scripts/launcher.sh"

LOAD_HF=$(flag_value --load-hf)
HF_MODEL=${HF_MODEL:-$LOAD_HF}
LOAD=$(flag_value --load)
if ! given --data-path && [ -z "${DATA_PATH:-}" ]; then
  # the demo chat set (or CHATS) rendered with the model's template; the demo model when none is given
  mapfile -t DEMO < <(HF_MODEL="$HF_MODEL" SEQ_LEN="$SEQ_LEN" bash "$ROOT/pretrain_scripts/prepare_sft_demo.sh" | tail -n 2)
  [ -n "$HF_MODEL" ] || [ -n "$LOAD" ] || HF_MODEL=${DEMO[0]}
  DATA_PATH=${DEMO[1]}
  TOKENIZER_MODEL=${TOKENIZER_MODEL:-${DEMO[0]}}
fi
NAME=$(basename "${HF_MODEL:-${LOAD:-model}}")
OUTPUT=${OUTPUT:-$(fresh_output "$ROOT/work_dirs/sft_$NAME")}
SAVE=${SAVE:-$OUTPUT/checkpoints}

ARGS=()
[ -z "$HF_MODEL" ] || given --load-hf || ARGS+=(--load-hf "$HF_MODEL")
common_args
ARGS+=(--sft --split 95,5,0 --weight-decay 0.0 --clip-grad 1.0 --adam-beta2 0.95 --eval-iters 4)
[ -z "${DATA_PATH:-}" ] || ARGS+=(--data-path "$DATA_PATH")
TOKENIZER_MODEL=${TOKENIZER_MODEL:-$HF_MODEL}
if ! given --tokenizer-type && [ -n "$TOKENIZER_MODEL" ]; then
  ARGS+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
fi
ARGS+=("$@")
(launch "$ROOT/pretrain_megatron_gpt.py")
given --validate-only && exit 0
if [ "${EXPORT_HF:-1}" = 1 ]; then
  echo "run_sft.sh: exporting the fine-tuned model to Hugging Face format -> $OUTPUT/hf" >&2
  rm -rf "$OUTPUT/hf"
  "$PY" "$ROOT/tools/convert_checkpoint.py" --direction mcore2hf --load-dir "$SAVE" --save-dir "$OUTPUT/hf"
fi
