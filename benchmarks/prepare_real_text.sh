#!/usr/bin/env bash
# Build a real-text pretraining corpus of 20M+ tokens offline, for comparing training runs (FP8 vs bf16 loss):
#   1. OUTDIR/corpus.jsonl: the docstrings, # comments and C/C++ header comments of this Python's standard library
#      and site-packages, plus their .md/.rst/.txt/METADATA/README/LICENSE files, deduplicated
#      (tools/build_text_corpus.py --code-text comments; docstrings alone give about 13M tokens with the
#      packages of the repository's .venv, too few);
#   2. OUTDIR/gpt2-vocab.json, gpt2-merges.txt: a byte-level BPE trained on it (tools/train_tokenizer.py --type gpt2);
#   3. OUTDIR/real_text_text_document.bin/.idx: the corpus tokenized with it (tools/preprocess_data.py --append-eod).
# Each step is skipped when its output exists (delete OUTDIR to rebuild). Prints the token count, checks it reaches
# MIN_TOKENS, and prints the --data-path prefix on the last line.
#   usage: benchmarks/prepare_real_text.sh OUTDIR
#   VOCAB_SIZE (default 32000)   WORKERS (default 2: preprocessing processes and tokenizer-training threads)
#   CODE_TEXT (default comments: docstrings | comments | source)   MIN_TOKENS (default 20000000)
#   PY (default: the repository's .venv if present, else python3; see pretrain_scripts/resolve_python.sh)
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 OUTDIR   (e.g. $0 data/real_text)" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/pretrain_scripts/resolve_python.sh"
mkdir -p "$1"
OUTDIR=$(cd "$1" && pwd)
VOCAB_SIZE=${VOCAB_SIZE:-32000}
WORKERS=${WORKERS:-2}
CODE_TEXT=${CODE_TEXT:-comments}
MIN_TOKENS=${MIN_TOKENS:-20000000}
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-$WORKERS}  # the tokenizers library's threads
PREFIX=$OUTDIR/real_text_text_document
cd "$ROOT"
START=$SECONDS

step() {  # step N TITLE: a header line with the elapsed time so far
  echo "[$1/3 at $((SECONDS - START)) s] $2" >&2
}

if [ ! -f "$OUTDIR/corpus.jsonl" ]; then
  step 1 "building the corpus (code text: $CODE_TEXT) -> $OUTDIR/corpus.jsonl"
  "$PY" tools/build_text_corpus.py --output "$OUTDIR/corpus.jsonl" --code-text "$CODE_TEXT" >&2
fi
if [ ! -f "$OUTDIR/gpt2-merges.txt" ]; then
  step 2 "training a byte-level BPE tokenizer (vocab $VOCAB_SIZE) -> $OUTDIR/gpt2-vocab.json, gpt2-merges.txt"
  "$PY" tools/train_tokenizer.py --type gpt2 --input "$OUTDIR/corpus.jsonl" --output-dir "$OUTDIR" \
    --vocab-size "$VOCAB_SIZE" >&2
fi
if [ ! -f "$PREFIX.idx" ]; then
  step 3 "tokenizing into Megatron .bin/.idx -> $PREFIX"
  "$PY" tools/preprocess_data.py --input "$OUTDIR/corpus.jsonl" --output-prefix "$OUTDIR/real_text" \
    --vocab-file "$OUTDIR/gpt2-vocab.json" --merge-file "$OUTDIR/gpt2-merges.txt" --dataset-impl mmap \
    --tokenizer-type GPT2BPETokenizer --append-eod --workers "$WORKERS" --log-interval 2000 >&2
fi
"$PY" - "$PREFIX" "$MIN_TOKENS" "$((SECONDS - START))" <<'EOF' >&2
import os, sys
from megatron_patch.data.indexed_dataset import IndexedDataset, bin_path

prefix, min_tokens, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ds = IndexedDataset(prefix)
tokens = int(ds.sequence_lengths.sum(dtype="int64"))
print(f"{prefix}: {ds.num_documents} documents, {tokens} tokens ({tokens / 1e6:.1f} M, end-of-document tokens "
      f"included), .bin {os.path.getsize(bin_path(prefix)) / 1e6:.1f} MB ({ds.dtype}); {seconds} s")
if tokens < min_tokens:
    sys.exit(f"error: {tokens} tokens, fewer than MIN_TOKENS={min_tokens}; rebuild with CODE_TEXT=source "
             "(whole Python files and headers) into a new OUTDIR, or install more packages")
EOF
echo "$PREFIX"
