# Shared by the pretraining launchers (run_gpt.sh, run_bert.sh); source it after setting ROOT and
# EXTRA=("$@") (the user's extra arguments). It provides:
#   given FLAG...        true when an extra argument is one of the flags (as --flag or --flag=value)
#   flag_value FLAG      the value an extra argument gives FLAG (--flag value or --flag=value), else empty
#   the settings every launcher shares (GPUS, NNODES, TP, PP, ZERO, SEQ_LEN, MBS, GBS, TRAIN_ITERS, LR, ...,
#   each an environment variable with a default; the launcher sets its model's defaults before sourcing),
#   common_args          appends their flags to ARGS
#   launch SCRIPT        checks the whole configuration once (SCRIPT --validate-only for GPUS x NNODES
#                        processes: a mistake is one `configuration error: ...` line and exit status 2), then
#                        execs torchrun SCRIPT "${ARGS[@]}", its output also written to
#                        $OUTPUT/logs/<launcher>_<date>_<time>.log (the path is printed first)
source "$ROOT/pretrain_scripts/resolve_python.sh"  # PY: $PY, else .venv, else python3; PYTHONUNBUFFERED=1

given() {
  local arg flag
  for arg in "${EXTRA[@]}"; do
    for flag in "$@"; do
      [[ $arg == "$flag" || $arg == "$flag="* ]] && return 0
    done
  done
  return 1
}
flag_value() {
  local i
  for ((i = 0; i < ${#EXTRA[@]}; i++)); do
    [[ ${EXTRA[i]} == "$1="* ]] && { echo "${EXTRA[i]#*=}"; return; }
    [[ ${EXTRA[i]} == "$1" ]] && { echo "${EXTRA[i + 1]:-}"; return; }
  done
  return 0  # not given: empty, and no failure for `set -e`
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
WARMUP_FRACTION=${WARMUP_FRACTION:-0.0667}
LOG_INTERVAL=${LOG_INTERVAL:-20}
EVAL_INTERVAL=${EVAL_INTERVAL:-100}
SAVE_INTERVAL=${SAVE_INTERVAL:-}         # default: one checkpoint, when training ends

# Defaults that depend on other settings (global batch, warmup, save interval, max positions) are not
# computed here, where a later flag could contradict them, but in Python from the final flags.
# The default OUTPUT of a launch that names none: BASE, or BASE_2, BASE_3 ... when an earlier run's checkpoints
# are there, so a second `make demo` trains anew beside the first instead of being refused (a run never writes
# into another run's checkpoints; OUTPUT=DIR or SAVE=DIR choose, --load BASE/checkpoints resumes the earlier run).
fresh_output() {
  local base=$1 out=$1 n=1
  if [ -z "${SAVE:-}" ]; then
    while [ -e "$out/checkpoints/latest_checkpointed_iteration.txt" ] || compgen -G "$out/checkpoints/iter_*" >/dev/null; do
      n=$((n + 1))
      out=${base}_$n
    done
  fi
  [ "$out" = "$base" ] || echo "$(basename "$0"): $base holds an earlier run's checkpoints; this run writes to $out" \
    "(resume the earlier run with --load $base/checkpoints; OUTPUT=DIR chooses the directory)" >&2
  printf '%s' "$out"
}

common_args() {
  ARGS+=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
        --seq-length "$SEQ_LEN" --micro-batch-size "$MBS" --train-iters "$TRAIN_ITERS"
        --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --split 969,30,1
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
}

launch() {
  local script=$1 check rc=0 log
  mkdir -p "$OUTPUT"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$([ "$HAS_GPU" = 1 ] && echo 8 || echo 1)}
  # One check for the whole job, here, before any worker starts: exits 2 with the reason on a mistake (a --save
  # directory holding another run's checkpoints included). Nothing is written for a refused run.
  check=$(env -u RANK -u LOCAL_RANK WORLD_SIZE=$((GPUS * NNODES)) "$PY" "$script" "${ARGS[@]}" --validate-only 2>&1) || rc=$?
  printf '%s\n' "$check" >&2
  [ "$rc" = 0 ] || exit "$rc"
  given --validate-only && exit 0
  # The job's log: everything it prints (stdout and stderr, each also to where it goes now), one file per launch.
  log=$OUTPUT/logs/$(basename "$0" .sh)_$(date +%Y%m%d_%H%M%S).log
  mkdir -p "$OUTPUT/logs"
  printf '%s\n' "$check" >> "$log"
  echo "$(basename "$0"): ${NNODES} node(s) x ${GPUS} process(es), log in $log" | tee -a "$log" >&2
  exec > >(tee -a "$log") 2> >(tee -a "$log" >&2)
  # MAX_RESTARTS=N: torchrun restarts every worker when one dies, up to N times; each attempt resumes from the
  # newest complete checkpoint in --save by itself (megatron_patch/config/restart.py)
  exec "$PY" -m torch.distributed.run --nproc-per-node "$GPUS" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --max-restarts "${MAX_RESTARTS:-0}" "$script" "${ARGS[@]}"
}
