"""The shared `main` of the pretraining entry points (pretrain_megatron_gpt.py, pretrain_megatron_bert.py).

The top of the house assembles the run: with --load-hf DIR the flags are parsed through the conversion
(conversion.hf_source: DIR's config.json gives the architecture) and the training loop is handed the loader of
DIR's weights, so neither the configuration nor the loop imports the conversion.
Flags are parsed and validated before torch and megatron-core are imported; `--validate-only` checks the
configuration and the data for WORLD_SIZE processes and stops. A configuration or data error is printed once
(by local rank 0 of each machine) as `configuration error: ...` or `data error: ...`, and every rank exits
with status 2. Light on purpose: nothing heavy is imported at module level.
"""
from __future__ import annotations

import os
import sys
from typing import List, Optional

from megatron_patch.config import Config, ConfigError
from megatron_patch.config.restart import resume_after_restart
from megatron_patch.conversion.hf_source import parse_args, weights_for  # light: no torch
from megatron_patch.data.checks import DataError
from megatron_patch.data.indexed_dataset import CorruptIndexError
from megatron_patch.data.tokenizers import TokenizerError


def report(kind: str, error: Exception) -> int:
    """Print `kind error: ...` once per machine; returns the exit status (2)."""
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
    warmup = (f"{cfg.warmup_iters} (--lr-warmup-fraction {cfg.lr_warmup_fraction:g})"
              if cfg.lr_warmup_fraction is not None else str(cfg.warmup_iters))
    every = f"every {cfg.save_interval} iterations and " if cfg.save_interval else ""
    save = f"to {cfg.save} {every}at the end" if cfg.save else "none"
    model = " ".join(x for x in (cfg.model_family or "custom", cfg.model_size) if x)
    if cfg.model_family == "bert":
        model += (f", masked LM (--mask-prob {cfg.mask_prob:g})"
                  + (" + next-sentence prediction" if cfg.bert_binary_head else ", no next-sentence head"))
    memory = [f"recompute {cfg.recompute_granularity}"] if cfg.recompute_granularity else []
    if "bf16" in (cfg.exp_avg_dtype, cfg.exp_avg_sq_dtype):
        memory.append(f"Adam moments {cfg.exp_avg_dtype}/{cfg.exp_avg_sq_dtype}")
    if cfg.grad_reduce_in_bf16:
        memory.append("bf16 gradients")
    if cfg.fp8_format:
        memory.append(f"FP8 {cfg.fp8_format} {cfg.fp8_recipe}")
    model_dtype = cfg.params_dtype_name + "".join(f", {m}" for m in memory)
    return (f"configuration ok for {cfg.world_size} process(es): {model} "
            f"({cfg.num_layers} layers, hidden {cfg.hidden_size}), "
            f"TP {cfg.tensor_model_parallel_size} x PP {cfg.pipeline_model_parallel_size} x DP {cfg.data_parallel_size}, "
            f"micro batch {cfg.micro_batch_size} x {cfg.num_microbatches} x DP {cfg.data_parallel_size} = "
            f"global batch {cfg.global_batch_size}, seq {cfg.seq_length}, {model_dtype}, ZeRO-{cfg.zero_stage}, "
            f"{cfg.train_iters} iterations, lr {cfg.lr:g} warmup {warmup} {cfg.lr_decay_style} decay over "
            f"{cfg.decay_iters}, checkpoints {save}\ndata: {data}")


def _pretrain(cfg: Config, model: str) -> None:
    load_weights = weights_for(cfg)  # --load-hf: the Hugging Face weights, through the family's table
    if model == "bert":
        from megatron_patch.training.bert import pretrain_bert

        pretrain_bert(cfg, load_weights)
    else:
        from megatron_patch.training.loop import pretrain

        pretrain(cfg, load_weights)


def main(argv: Optional[List[str]] = None, model: str = "gpt") -> int:
    """Run one pretraining process: `model` is "gpt" (GPT/Llama families) or "bert". Returns the exit status."""
    # Logs go to files and pipes as often as to terminals: hand each line over when it is printed, not
    # when an 8 KB buffer fills or the process exits (the launchers also set PYTHONUNBUFFERED=1).
    sys.stdout.reconfigure(line_buffering=True)
    try:
        cfg = parse_args(argv, model=model)
        # A restarted attempt of an elastic job (torchrun --max-restarts) resumes from its newest checkpoint.
        cfg, restarted = resume_after_restart(cfg)
        if restarted and int(os.environ.get("RANK", "0")) == 0:
            print(restarted, flush=True)
        # Before torch and megatron-core are imported and before any process group exists.
        cfg = cfg.validate(int(os.environ.get("WORLD_SIZE", "1")))
        if model == "bert":
            from megatron_patch.config.validate import validate_bert_pretraining

            validate_bert_pretraining(cfg)
        if cfg.validate_only:
            from megatron_patch.training.data import check_data

            print(describe(cfg, check_data(cfg)))
            return 0
        from megatron_patch.compat.quiet import quiet_known_noise  # imports torch: not for --validate-only

        quiet_known_noise()  # before megatron-core is imported: its known harmless warnings
        _pretrain(cfg, model)
    except ConfigError as e:
        return report("configuration", e)
    except (DataError, CorruptIndexError, TokenizerError) as e:
        return report("data", e)
    except Exception as e:
        from megatron_patch.training.checkpoint import CheckpointError  # imported only once training started

        if isinstance(e, CheckpointError):
            return report("checkpoint", e)
        raise
    finally:
        destroy_process_groups()
    return 0


def destroy_process_groups() -> None:
    """Tear down the process groups this process set up (megatron-core's, torch's default) before the interpreter
    exits, where leaving them was seen to abort a rank of a finished run ("terminate called without an active
    exception"). Imports nothing: a process that never imported them has none."""
    parallel = sys.modules.get("megatron_patch.parallel")  # imported only once megatron-core training started
    if parallel is not None:
        parallel.destroy()
        return
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
