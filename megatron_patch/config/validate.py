"""From the flags to the configuration a run starts with, in three steps, before any process group starts:

- `resolve(cfg, world_size)`: pure (no I/O) derivation of the dependent settings (global batch, max positions,
  recompute granularity, mock data's vocabulary) and the layout for `world_size` processes;
- `checks.run_checks(cfg)`: the table of named rules (checks.py), each refusal a sentence naming the flags and fix;
- `check_paths(cfg)`: the file system, at the entry point: --save writable, --load present, both compared with the
  checkpoints on disk (resume.py).

`validate(cfg, world_size)` (= `Config.validate`) runs the three and returns the resolved Config.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .checks import run_checks
from .errors import ConfigError
from .resume import check_resume

if TYPE_CHECKING:  # annotations only
    from .config import Config


def _fail(msg: str) -> None:
    raise ConfigError(msg)


def check_save_dir(path: str) -> None:
    """--save must be a directory this process can create and write, before any training happens."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        _fail(f"--save {path} is not a writable directory ({e.strerror or e}); choose a directory you can write to, "
              f"or fix its permissions")


def check_load_dir(path: str) -> None:
    """--load must exist: a mistyped path must not silently train from scratch."""
    if not os.path.isdir(path):
        what = "is a file, not a checkpoint directory" if os.path.exists(path) else "does not exist"
        _fail(f"--load {path} {what}; give the directory that holds latest_checkpointed_iteration.txt and iter_* "
              f"(to start from scratch, create an empty directory or drop --load)")


def validate_bert_pretraining(c: Config) -> None:
    """The rules of BERT pretraining (pretrain_megatron_bert.py) for a validated `c`: its data and objective
    (checks_bert.py, concern bert_pretraining)."""
    run_checks(c, concerns=("bert_pretraining",))


def resolve(c: Config, world_size: int) -> Config:
    """`c` with its dependent defaults and layout for `world_size` processes (a new Config; no I/O). Safe on any
    input: impossible values are left for the checks to refuse."""
    tp, pp = max(c.tensor_model_parallel_size, 1), max(c.pipeline_model_parallel_size, 1)
    dp = world_size // (tp * pp)
    if c.num_experts:
        etp = c.expert_tp_size
        edp = world_size // max(etp * c.expert_model_parallel_size * pp, 1)
    else:
        edp = dp
    gbs = c.global_batch_size if c.global_batch_size is not None else c.micro_batch_size * dp
    per_step = c.micro_batch_size * dp
    return c.replace(
        global_batch_size=gbs,
        max_position_embeddings=c.seq_length if c.max_position_embeddings is None else c.max_position_embeddings,
        calculate_per_token_loss=c.calculate_per_token_loss or c.sft,
        recompute_granularity="full" if c.checkpoint_activations and c.recompute_granularity is None
        else c.recompute_granularity,
        vocab_size=1024 if c.mock_data and not c.data_path and c.vocab_size is None else c.vocab_size,
        world_size=world_size, data_parallel_size=dp, expert_data_parallel_size=edp,
        num_microbatches=gbs // per_step if per_step > 0 else 0)


def check_paths(c: Config) -> None:
    """The file-system checks of the entry point: --save writable (created), --load present, and both against the
    checkpoints they hold (another run's, a changed schedule: resume.py)."""
    if c.save:
        check_save_dir(c.save)
    if c.load:
        check_load_dir(c.load)
    # Last: these compare the final settings (layout, global batch) with the checkpoints in --load and --save.
    check_resume(c)


def validate(c: Config, world_size: int) -> Config:
    """The configuration a run of `world_size` processes starts with: resolved, checked by every rule, and checked
    against the file system. Raises ConfigError with the first refusal."""
    resolved = resolve(c, world_size)
    run_checks(resolved)
    check_paths(resolved)
    return resolved.replace(checked=True)


MODEL_CONCERNS = ("layout", "moe", "model")


def validate_model(c: Config, world_size: int) -> Config:
    """For a run that builds the model but does not train it (conversion, verification): resolved, checked by the
    rules of the layout, the experts and the model only (no data, schedule or checkpoint rules), marked checked."""
    resolved = resolve(c, world_size)
    run_checks(resolved, concerns=MODEL_CONCERNS)
    return resolved.replace(checked=True)
