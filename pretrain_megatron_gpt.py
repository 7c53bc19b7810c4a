#!/usr/bin/env python3
"""Pretrain a GPT/Llama-family model with megatron-core. Launch with torchrun (or plainly for one process):

    torchrun --nproc-per-node 8 pretrain_megatron_gpt.py --model-family llama --model-size 1.3b --bf16 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --data-path my_text_document ...

`pretrain_scripts/run_gpt.sh` wraps this with defaults. `--help` lists every flag.

A configuration or data error is printed once (by local rank 0 of each machine) as `configuration error: ...` or `data error: ...`,
and every rank exits with status 2. `WORLD_SIZE=8 python pretrain_megatron_gpt.py ... --validate-only` makes
the same checks for 8 processes without starting any, which is what the launchers do before torchrun.
"""
import os
import sys
import warnings

# megatron-core announces at import time that it falls back to torch kernels without TE/apex; the
# run's own log says which implementation it uses.
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|absl|GPTModel IS DEPRECATED).*")

from megatron_patch.config import Config, ConfigError, parse_args  # light: no torch, no megatron-core
from megatron_patch.data.checks import DataError
from megatron_patch.data.indexed_dataset import CorruptIndexError
from megatron_patch.data.tokenizers import TokenizerError


def _report(kind: str, error: Exception) -> int:
    # Every rank of a machine sees the same flags and files and fails alike: its local rank 0 says why, so
    # the log of each machine (one log on a single machine) holds the message once, without a traceback.
    if int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) == 0:
        print(f"{kind} error: {error}", file=sys.stderr, flush=True)
    else:  # torchrun stops every worker once one exits: give local rank 0 (slower on a loaded host) time to say why
        import time

        time.sleep(5)
    return 2


def describe(cfg: Config, data: str) -> str:
    """The resolved settings, in a few words (printed by --validate-only)."""
    zero = 2 if cfg.zero_2_memory_optimization else 1 if cfg.zero_1_memory_optimization else 0
    warmup = (f"{cfg.warmup_iters} (--lr-warmup-fraction {cfg.lr_warmup_fraction:g})"
              if cfg.lr_warmup_fraction is not None else str(cfg.warmup_iters))
    every = f"every {cfg.save_interval} iterations and " if cfg.save_interval else ""
    save = f"to {cfg.save} {every}at the end" if cfg.save else "none"
    model = " ".join(x for x in (cfg.model_family or "custom", cfg.model_size) if x)
    return (f"configuration ok for {cfg.world_size} process(es): {model} "
            f"({cfg.num_layers} layers, hidden {cfg.hidden_size}), "
            f"TP {cfg.tensor_model_parallel_size} x PP {cfg.pipeline_model_parallel_size} x DP {cfg.data_parallel_size}, "
            f"micro batch {cfg.micro_batch_size} x {cfg.num_microbatches} x DP {cfg.data_parallel_size} = "
            f"global batch {cfg.global_batch_size}, seq {cfg.seq_length}, {cfg.params_dtype_name}, ZeRO-{zero}, "
            f"{cfg.train_iters} iterations, lr {cfg.lr:g} warmup {warmup} {cfg.lr_decay_style} decay over "
            f"{cfg.decay_iters}, checkpoints {save}\ndata: {data}")


def main(argv=None) -> int:
    # Logs go to files and pipes as often as to terminals: hand each line over when it is printed, not
    # when an 8 KB buffer fills or the process exits (the launchers also set PYTHONUNBUFFERED=1).
    sys.stdout.reconfigure(line_buffering=True)
    try:
        cfg = parse_args(argv)
        # Before torch and megatron-core are imported and before any process group exists.
        cfg.validate(int(os.environ.get("WORLD_SIZE", "1")))
        if cfg.validate_only:
            from megatron_patch.training.data import check_data

            print(describe(cfg, check_data(cfg)))
            return 0
        from megatron_patch.training.loop import pretrain

        pretrain(cfg)
    except ConfigError as e:
        return _report("configuration", e)
    except (DataError, CorruptIndexError, TokenizerError) as e:
        return _report("data", e)
    except Exception as e:
        from megatron_patch.training.checkpoint import CheckpointError  # imported only once training started

        if isinstance(e, CheckpointError):
            return _report("checkpoint", e)
        raise
    finally:
        parallel = sys.modules.get("megatron_patch.parallel")  # imported only once training started
        if parallel is not None:
            parallel.destroy()
    return 0


if __name__ == "__main__":  # dist_checkpointing starts helper processes: keep the guard
    sys.exit(main())
