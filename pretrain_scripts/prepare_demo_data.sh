#!/usr/bin/env bash
# Build the built-in demo data, offline: a JSONL corpus of real English (the docstrings of Python's
# standard library), a GPT-2 style BPE tokenizer trained on it, and its Megatron .bin/.idx files.
# Each step is skipped when its output exists. Prints the --data-path prefix on the last line.
#   DEMO_DIR (default data/demo)   VOCAB_SIZE (default 8000)
#   HF_TOKENIZER: a Hugging Face model directory; the corpus is then tokenized with its tokenizer instead
#   DEMO_MODEL=bert: a lower-cased WordPiece vocabulary (bert-vocab.txt) instead, and the corpus split into
#     sentences (--split-sentences) for BERT's next-sentence pairs: prefix $DEMO_DIR/bert_text_sentence
#   PY (default: the repository's .venv if present, else python3; see resolve_python.sh)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/pretrain_scripts/resolve_python.sh"
DEMO_DIR=${DEMO_DIR:-$ROOT/data/demo}
VOCAB_SIZE=${VOCAB_SIZE:-8000}
mkdir -p "$DEMO_DIR"
cd "$ROOT"

if [ ! -f "$DEMO_DIR/corpus.jsonl" ]; then
  echo "[1/3] building the demo corpus (stdlib docstrings) -> $DEMO_DIR/corpus.jsonl" >&2
  "$PY" -m megatron_patch.demo.corpus --output "$DEMO_DIR/corpus.jsonl" >&2
fi
if [ -n "${HF_TOKENIZER:-}" ]; then
  PREFIX="$DEMO_DIR/hf_$(basename "$HF_TOKENIZER")"
  if [ ! -f "${PREFIX}_text_document.idx" ]; then
    echo "[2/2] tokenizing with $HF_TOKENIZER's tokenizer into Megatron .bin/.idx -> ${PREFIX}_text_document" >&2
    "$PY" tools/preprocess_data.py --input "$DEMO_DIR/corpus.jsonl" --output-prefix "$PREFIX" --dataset-impl mmap \
      --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_TOKENIZER" --append-eod --workers 2 \
      --log-interval 2000 >&2
  fi
  echo "${PREFIX}_text_document"
  exit 0
fi
if [ "${DEMO_MODEL:-gpt}" = bert ]; then
  if [ ! -f "$DEMO_DIR/bert-vocab.txt" ]; then
    echo "[2/3] training a lower-cased WordPiece vocabulary ($VOCAB_SIZE) -> $DEMO_DIR/bert-vocab.txt" >&2
    "$PY" tools/train_tokenizer.py --type wordpiece --input "$DEMO_DIR/corpus.jsonl" --output-dir "$DEMO_DIR" \
      --output-prefix bert --vocab-size "$VOCAB_SIZE" >&2
  fi
  if [ ! -f "$DEMO_DIR/bert_text_sentence.idx" ]; then
    echo "[3/3] splitting into sentences and tokenizing into Megatron .bin/.idx -> $DEMO_DIR/bert_text_sentence" >&2
    "$PY" tools/preprocess_data.py --input "$DEMO_DIR/corpus.jsonl" --output-prefix "$DEMO_DIR/bert" \
      --vocab "$DEMO_DIR/bert-vocab.txt" --dataset-impl mmap --tokenizer-type BertWordPieceLowerCase \
      --split-sentences --workers 2 --log-interval 2000 >&2
  fi
  echo "$DEMO_DIR/bert_text_sentence"
  exit 0
fi
if [ ! -f "$DEMO_DIR/gpt2-merges.txt" ]; then
  echo "[2/3] training a GPT-2 BPE tokenizer (vocab $VOCAB_SIZE) -> $DEMO_DIR/gpt2-vocab.json, gpt2-merges.txt" >&2
  "$PY" tools/train_tokenizer.py --type gpt2 --input "$DEMO_DIR/corpus.jsonl" --output-dir "$DEMO_DIR" \
    --vocab-size "$VOCAB_SIZE" >&2
fi
if [ ! -f "$DEMO_DIR/demo_text_document.idx" ]; then
  echo "[3/3] tokenizing into Megatron .bin/.idx -> $DEMO_DIR/demo_text_document" >&2
  "$PY" tools/preprocess_data.py --input "$DEMO_DIR/corpus.jsonl" --output-prefix "$DEMO_DIR/demo" \
    --vocab "$DEMO_DIR/gpt2-vocab.json" --merge-file "$DEMO_DIR/gpt2-merges.txt" --dataset-impl mmap \
    --tokenizer-type GPT2BPETokenizer --append-eod --workers 2 --log-interval 2000 >&2
fi
echo "$DEMO_DIR/demo_text_document"
