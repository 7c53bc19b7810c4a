#!/usr/bin/env bash
# Pretrain BERT (masked LM + next-sentence prediction) with megatron-core. With no arguments: builds the
# offline demo data (pretrain_scripts/prepare_demo_data.sh with DEMO_MODEL=bert: the demo corpus split into
# sentences and a lower-cased WordPiece vocabulary trained on it) and trains a tiny BERT for 300 iterations
# on the GPU if there is one, else on the CPU (gloo); the log shows the masked-LM and next-sentence losses
# ("lm loss", "nsp loss") falling. Every setting is an environment variable with a default (the shared ones
# are in launcher.sh); any extra argument is passed to pretrain_megatron_bert.py (see its --help) after the
# launcher's own flags, so it wins over them, e.g.
#   TP=2 GPUS=2 MODEL_SIZE=base bash pretrain_scripts/run_bert.sh --bert-no-binary-head --train-iters 1000
# Own data: DATA_PATH=corpus_text_sentence VOCAB_FILE=vocab.txt (tools/preprocess_data.py --split-sentences
# --tokenizer-type BertWordPieceLowerCase --vocab-file vocab.txt made it).
# With --validate-only among the arguments, the launcher stops after checking configuration and data.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
EXTRA=("$@")
# Before launcher.sh: BERT's own defaults for the shared settings. Short samples, many of them: each carries
# one next-sentence label, and on a CPU both losses then fall visibly within the 300 demo iterations.
SEQ_LEN=${SEQ_LEN:-64}
MBS=${MBS:-48}
source "$ROOT/pretrain_scripts/launcher.sh"

MODEL_SIZE=${MODEL_SIZE:-tiny}           # tiny | base | large
if [ -z "${OUTPUT:-}" ]; then
  LOAD=$(flag_value --load)
  if [ -n "$LOAD" ] && [ "$(basename "$LOAD")" = checkpoints ]; then
    OUTPUT=$(dirname "$LOAD")  # resuming a launcher run: it continues in place
  else
    OUTPUT=$(fresh_output "$ROOT/work_dirs/bert_${MODEL_SIZE}")
  fi
fi
SAVE=${SAVE:-$OUTPUT/checkpoints}

if [ -f "$(flag_value --load)/latest_checkpointed_iteration.txt" ]; then
  ARGS=()  # resuming: the architecture is stored with the checkpoint
else
  ARGS=(--model-size "$MODEL_SIZE")
fi
common_args
ARGS+=(--weight-decay 0.01 --clip-grad 1.0)  # BERT's AdamW settings (betas 0.9, 0.999)
if [ -n "${DATA_PATH:-}" ]; then
  # DATA_PATH may be "prefix" or "w1 prefix1 w2 prefix2" (sentence-split .bin/.idx).
  read -r -a DATA_ARGS <<< "$DATA_PATH"
  ARGS+=(--data-path "${DATA_ARGS[@]}" --tokenizer-type "${TOKENIZER_TYPE:-BertWordPieceLowerCase}")
  [ -z "${VOCAB_FILE:-}" ] || ARGS+=(--vocab-file "$VOCAB_FILE")
elif ! given --data-path; then
  DATA_PATH=$(DEMO_MODEL=bert bash "$ROOT/pretrain_scripts/prepare_demo_data.sh" | tail -n 1)
  ARGS+=(--data-path "$DATA_PATH" --tokenizer-type BertWordPieceLowerCase --vocab-file "$(dirname "$DATA_PATH")/bert-vocab.txt")
fi
ARGS+=("$@")
launch "$ROOT/pretrain_megatron_bert.py"
