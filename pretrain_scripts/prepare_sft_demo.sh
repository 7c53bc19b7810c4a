#!/usr/bin/env bash
# Build the built-in SFT demo, offline: a chat set (megatron_patch.demo.chats), a Qwen-style tokenizer trained on it
# with a ChatML chat template, a tiny Qwen3 Hugging Face model with random weights (tools/build_hf_model.py) and
# the chat set rendered with its template (tools/preprocess_data.py --sft). Each step is skipped when its output
# exists. Prints the model directory, then the --data-path prefix, on the last two lines.
#   SFT_DEMO_DIR (default data/sft_demo)   CONVERSATIONS (default 3000)   SEQ_LEN (default 256)
#   HF_MODEL: a Hugging Face model directory to render the chat set for instead (its tokenizer and template)
#   CHATS: your own conversations (JSONL: {"messages": [...]} or {"prompt", "response"}) instead of the demo set
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/pretrain_scripts/resolve_python.sh"
DIR=${SFT_DEMO_DIR:-$ROOT/data/sft_demo}
CONVERSATIONS=${CONVERSATIONS:-3000}
SEQ_LEN=${SEQ_LEN:-256}
mkdir -p "$DIR"
cd "$ROOT"

CHATS=${CHATS:-$DIR/chats.jsonl}
if [ ! -f "$CHATS" ]; then
  echo "[1/4] building the demo chat set ($CONVERSATIONS conversations) -> $CHATS" >&2
  "$PY" -m megatron_patch.demo.chats --output "$CHATS" --count "$CONVERSATIONS" >&2
fi
MODEL=${HF_MODEL:-$DIR/qwen3_tiny}
if [ -z "${HF_MODEL:-}" ] && [ ! -f "$MODEL/config.json" ]; then
  echo "[2/4] training a Qwen-style tokenizer on it -> $DIR/tokenizer" >&2
  "$PY" -m megatron_patch.demo.chats --texts "$CHATS" --output "$DIR/chat_texts.jsonl" >&2
  "$PY" tools/train_tokenizer.py --type qwen --input "$DIR/chat_texts.jsonl" --output-dir "$DIR/tokenizer" \
    --vocab-size 1024 >&2
  echo "[3/4] building a tiny Qwen3 model with random weights -> $MODEL" >&2
  "$PY" tools/build_hf_model.py --model-family qwen3 --model-size tiny --tokenizer-dir "$DIR/tokenizer" \
    --save-dir "$MODEL" --max-position-embeddings 4096 >&2
fi
PREFIX=$DIR/$(basename "$CHATS" .jsonl)_$(basename "$MODEL")_$SEQ_LEN
if [ ! -f "${PREFIX}_text_document.idx" ]; then
  echo "[4/4] rendering the chat set with $MODEL's chat template -> ${PREFIX}_text_document" >&2
  "$PY" tools/preprocess_data.py --sft --input "$CHATS" --tokenizer-model "$MODEL" \
    --output-prefix "$PREFIX" --seq-length "$SEQ_LEN" >&2
fi
echo "$MODEL"
echo "${PREFIX}_text_document"
