#!/usr/bin/env bash
# Pretrain a GPT-family model with megatron-core. With no arguments: builds the offline demo corpus and
# tokenizer (pretrain_scripts/prepare_demo_data.sh) and trains a tiny GPT for 300 iterations on the GPU
# if there is one, else on the CPU (gloo). Every setting is an environment variable with a default;
# any extra argument is passed to pretrain_megatron_gpt.py (see its --help), e.g.
#   TP=2 PP=2 GPUS=8 MODEL_SIZE=1.3b bash pretrain_scripts/run_gpt.sh --bf16
# Multi-node: the same command on every node with NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT set.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)

HAS_GPU=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
if [ "$HAS_GPU" = 1 ]; then
  DEFAULT_GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
  DEFAULT_PRECISION=bf16
else
  DEFAULT_GPUS=1
  DEFAULT_PRECISION=fp32
fi

MODEL_FAMILY=${MODEL_FAMILY:-gpt}        # gpt | llama | qwen2 | mistral
MODEL_SIZE=${MODEL_SIZE:-tiny}           # tiny | 125m | 350m | 1.3b | ... (see --help)
GPUS=${GPUS:-$DEFAULT_GPUS}              # processes per node (one per GPU; CPU processes without GPUs)
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
TP=${TP:-1}
PP=${PP:-1}
ZERO=${ZERO:-0}                          # 0 | 1 (distributed optimizer) | 2 (Megatron-FSDP, grads sharded too)
PRECISION=${PRECISION:-$DEFAULT_PRECISION}  # fp32 | bf16 | fp16
SEQ_LEN=${SEQ_LEN:-128}
MBS=${MBS:-8}
GBS=${GBS:-$((MBS * GPUS * NNODES / TP / PP))}
TRAIN_ITERS=${TRAIN_ITERS:-300}
LR=${LR:-1e-3}
MIN_LR=${MIN_LR:-1e-4}
WARMUP=${WARMUP:-$((TRAIN_ITERS / 15))}
LOG_INTERVAL=${LOG_INTERVAL:-20}
EVAL_INTERVAL=${EVAL_INTERVAL:-100}
OUTPUT=${OUTPUT:-$ROOT/work_dirs/${MODEL_FAMILY}_${MODEL_SIZE}}
SAVE=${SAVE:-$OUTPUT/checkpoints}
SAVE_INTERVAL=${SAVE_INTERVAL:-$TRAIN_ITERS}

if [ -z "${DATA_PATH:-}" ]; then
  DATA_PATH=$(bash "$ROOT/pretrain_scripts/prepare_demo_data.sh" | tail -n 1)
  DEMO_DIR=$(dirname "$DATA_PATH")
  TOKENIZER_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "$DEMO_DIR/gpt2-vocab.json"
                  --merge-file "$DEMO_DIR/gpt2-merges.txt")
else
  # DATA_PATH may be "prefix" or "w1 prefix1 w2 prefix2"; give the tokenizer through TOKENIZER_ARGS.
  read -r -a TOKENIZER_ARGS <<< "${TOKENIZER_ARGS:-}"
fi
read -r -a DATA_ARGS <<< "$DATA_PATH"

PRECISION_ARGS=()
case "$PRECISION" in
  bf16) PRECISION_ARGS=(--bf16) ;;
  fp16) PRECISION_ARGS=(--fp16) ;;
  fp32) ;;
  *) echo "PRECISION=$PRECISION: choose fp32, bf16 or fp16" >&2; exit 2 ;;
esac
ZERO_ARGS=()
case "$ZERO" in
  0) ;;
  1|2) ZERO_ARGS=(--zero-$ZERO-memory-optimization) ;;
  *) echo "ZERO=$ZERO: choose 0, 1 or 2" >&2; exit 2 ;;
esac

mkdir -p "$OUTPUT"
echo "run_gpt.sh: ${MODEL_FAMILY} ${MODEL_SIZE}, ${NNODES} node(s) x ${GPUS} process(es), TP=${TP} PP=${PP} ZeRO=${ZERO}, ${PRECISION}, log in $OUTPUT" >&2
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$([ "$HAS_GPU" = 1 ] && echo 8 || echo 1)}
exec "$PY" -m torch.distributed.run --nproc-per-node "$GPUS" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  "$ROOT/pretrain_megatron_gpt.py" \
  --model-family "$MODEL_FAMILY" --model-size "$MODEL_SIZE" \
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
  --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN" \
  --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$TRAIN_ITERS" \
  --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$WARMUP" \
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 \
  --data-path "${DATA_ARGS[@]}" "${TOKENIZER_ARGS[@]}" --split 969,30,1 \
  --data-cache-path "$OUTPUT/index_cache" \
  --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters 10 \
  --save "$SAVE" --save-interval "$SAVE_INTERVAL" --tensorboard-dir "$OUTPUT/tensorboard" \
  --metrics-file "$OUTPUT/metrics.jsonl" \
  "${PRECISION_ARGS[@]}" "${ZERO_ARGS[@]}" "$@"
