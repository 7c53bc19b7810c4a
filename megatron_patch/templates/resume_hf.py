"""The learning-rate schedule a Hugging Face PreTrainer run continues from --load: Megatron-LM's rule, as the engine
keeps it (config/resume.py: the same stored settings, the same comparison, the same one-line refusal).

Each checkpoint stores the settings of the schedule in effect (checkpoint.json: "scheduler", counted in samples as
the engine stores megatron-core's, and "config": --train-iters and --global-batch-size). On resume:

- flags that give the same schedule continue it;
- flags that change it (--lr, --min-lr, --lr-decay-iters or a --train-iters it defaults to, --lr-decay-style,
  warmup, --weight-decay, or a longer --train-iters past a decay that ended with the checkpoint's run) are refused,
  unless --override-opt-param-scheduler (this run's schedule, peak lr and weight decay, from the checkpoint's step)
  or --use-checkpoint-opt-param-scheduler (the checkpoint's schedule rebuilt from its settings, with its peak lr
  and weight decay);
- a scheduler of model_optimizer_lr_scheduler_provider() restores its own state; the two flags are refused there.

Either way the first resumed step's lr is the chosen schedule's at the restored step, not the lr saved with the
scheduler state (the saving run's schedule computed that one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from megatron_patch.config import Config, ConfigError
from megatron_patch.config.resume import HF, HF_FORMAT, check_schedule, check_scheduler_flags, scheduler_settings
from megatron_patch.config.checkpoint_layout import checkpoint_dir, read_manifest

from .schedule import Schedule

OVERRIDE, KEEP = "--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"


@dataclass(frozen=True)
class Plan:
    """The schedule a run follows: `schedule` None for the user's own scheduler; `from_checkpoint` when it is the
    checkpoint's (--use-checkpoint-opt-param-scheduler); `settings` what its checkpoints store; `note` for the log."""
    schedule: Optional[Schedule]
    from_checkpoint: bool
    settings: Optional[Dict]
    note: str = ""

    def manifest_entries(self, cfg: Config) -> Optional[Dict]:
        """What checkpoint.json records of the schedule (None: the user's scheduler, nothing to compare)."""
        if self.settings is None:
            return None
        return {"scheduler": self.settings,
                "config": {"train_iters": cfg.train_iters, "global_batch_size": cfg.global_batch_size}}


def plan(cfg: Config, load: Optional[str], iteration: Optional[int], own_scheduler: bool) -> Plan:
    """The schedule of this run, resuming checkpoint `iteration` of `load` (None: not resuming). ConfigError (one
    line) for a changed schedule without one of the two flags, or a flag that cannot act."""
    resuming = iteration is not None
    check_scheduler_flags(cfg, resuming and not own_scheduler,
                          "the scheduler of model_optimizer_lr_scheduler_provider() restores its own state"
                          if resuming else "it applies when resuming a checkpoint with --load")
    if own_scheduler:
        return Plan(None, False, None)
    settings = scheduler_settings(cfg, HF)
    mine = Plan(Schedule.from_settings(settings, cfg.global_batch_size), False, settings)
    if not resuming:
        return mine
    where = f"--load {load}"
    manifest = read_manifest(checkpoint_dir(load, iteration))
    if manifest.get("format") != HF_FORMAT:
        return mine  # an engine checkpoint: loading it refuses it, saying what it is
    refusal = check_schedule(cfg, manifest, where)
    if refusal:
        raise ConfigError(refusal)
    if cfg.override_opt_param_scheduler:
        return Plan(mine.schedule, False, settings,
                    f"lr schedule: this run's flags ({OVERRIDE}), from the checkpoint's step")
    if not cfg.use_checkpoint_opt_param_scheduler:
        return mine
    stored = manifest.get("scheduler")
    if not stored:
        raise ConfigError(f"{KEEP}: {where} (iteration {iteration}) stores no learning-rate schedule (its run used the "
                          f"scheduler of model_optimizer_lr_scheduler_provider()); drop the flag")
    old_gbs = manifest.get("config", {}).get("global_batch_size") or cfg.global_batch_size
    theirs = Schedule.from_settings(stored, old_gbs)
    gbs = cfg.global_batch_size  # the settings this run's checkpoints store, in its own global batch
    kept = dict(stored, lr_warmup_steps=theirs.warmup * gbs, lr_decay_steps=theirs.decay * gbs,
                wd_incr_steps=cfg.train_iters * gbs)
    return Plan(theirs, True, kept,
                f"lr schedule: the checkpoint's ({KEEP}: --lr {theirs.lr:g}, --min-lr {theirs.min_lr:g}, warmup "
                f"{theirs.warmup}, {theirs.style} decay over {theirs.decay} iterations, --weight-decay "
                f"{stored['start_wd']:g})")


def group_settings(optimizer) -> List[tuple]:
    """(peak lr, weight decay) of each param group, as this run built them: call before loading a checkpoint."""
    return [(g.get("initial_lr", g["lr"]), g.get("weight_decay")) for g in optimizer.param_groups]


def continue_schedule(scheduler, optimizer, peaks: Sequence[float], weight_decays: Sequence[Optional[float]]) -> None:
    """Set each param group's peak lr and weight decay, and its lr for the next step: `scheduler`'s lambda (the
    chosen schedule) at its restored step, times the peak. `scheduler` is a LambdaLR whose state was loaded."""
    step = scheduler.last_epoch
    lrs = [peak * fn(step) for peak, fn in zip(peaks, scheduler.lr_lambdas)]
    for group, peak, lr, wd in zip(optimizer.param_groups, peaks, lrs, weight_decays):
        group["initial_lr"], group["lr"] = peak, lr
        if wd is not None:
            group["weight_decay"] = wd
    scheduler.load_state_dict(dict(scheduler.state_dict(), base_lrs=list(peaks), _last_lr=lrs))
