"""What resuming from `--load` restores, and the two things a run refuses before it starts (Megatron-LM's rules):

- a learning-rate schedule that the flags change silently. The checkpoint stores megatron-core's scheduler
  state (in samples: warmup and decay steps are iterations x global batch). A resume whose --lr, --min-lr,
  decay length (--lr-decay-iters, which defaults to --train-iters), --lr-decay-style, warmup or --weight-decay
  differ from it is refused unless --override-opt-param-scheduler (this run's settings, continued from the
  checkpoint's step) or --use-checkpoint-opt-param-scheduler (the checkpoint's) says which wins. --train-iters
  is not a scheduler field: a longer run past the end of a decay that ended with the checkpoint's run (the
  extra iterations would train at --min-lr) is refused the same way.
- a --save directory that holds another run's checkpoints: a run writes only into an empty --save, or into
  the directory it resumes (--load is the same directory). Same model or not, so a second run never re-points
  the tracker of the first.

The Hugging Face PreTrainer (templates/pretrain_hf.py) keeps the same rule with the same stored settings and
wording (`HF`: its LambdaLR counts optimizer steps, not samples, and its --lr-warmup-fraction is a share of
--train-iters).

Everything here reads the flags and the checkpoint's checkpoint.json only (no torch), so `validate()` runs it
before any process group starts; the Checkpointer applies the same `restores` rule when it loads.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional

from .errors import ConfigError
from .model_source import ARCHITECTURE, FLAG, newest_manifest

if TYPE_CHECKING:  # annotations only: Config.validate() calls these checks
    from .config import Config


def layout(cfg: Config) -> Dict[str, int]:
    """The run's parallel layout as a checkpoint records it."""
    out = {"tp": cfg.tensor_model_parallel_size, "pp": cfg.pipeline_model_parallel_size,
           "dp": cfg.data_parallel_size, "vpp": cfg.virtual_pipeline_model_parallel_size or 1, "zero": cfg.zero_stage}
    if cfg.num_experts:  # expert layout (absent: a dense model, or EP 1 / ETP TP)
        out.update(ep=cfg.expert_model_parallel_size,
                   etp=cfg.expert_tp_size)
    return out


def _expert_layout(lay: Dict[str, int]):
    return lay.get("ep", 1), lay.get("etp", lay["tp"])


def bound_to_saved_layout(manifest: Dict) -> bool:
    """True for a checkpoint that loads only at its own TP/PP/VPP and expert layout (at any DP size): a ZeRO-2
    (fsdp_dtensor) checkpoint written before they became fully reshardable, whose SwiGLU fc1 interleaves the TP
    ranks' halves (training/checkpoint/fsdp_dtensor.py). Every other checkpoint's weights load at any layout."""
    return manifest.get("format") == "fsdp_dtensor" and (
        manifest.get("optimizer_sharding") != "fully_reshardable")


def at_saved_layout(manifest: Dict, mine: Dict[str, int]) -> bool:
    """True when the layout `mine` (layout(cfg)) is the checkpoint's but for the DP size."""
    return {**manifest["layout"], "dp": 0} == {**mine, "dp": 0}


@dataclass(frozen=True)
class Restore:
    """What loading a checkpoint restores into this run."""
    model_only: bool  # the checkpoint holds weights only (e.g. converted from Hugging Face)
    same_model_layout: bool  # TP, PP, VPP and the expert layout unchanged: the RNG streams carry over
    optimizer_fits: bool  # the saved optimizer state can be loaded into this layout
    optimizer: bool  # the optimizer state and the learning-rate schedule are restored
    starts_lora: bool = False  # a checkpoint without adapters loaded by a LoRA run: its weights are the frozen base


def restores(manifest: Dict, cfg: Config) -> Restore:
    """What resuming from the checkpoint of `manifest` restores into the run of `cfg` (validated)."""
    saved, mine = manifest["layout"], layout(cfg)
    starts_lora = bool(cfg.lora_rank) and not manifest.get("config", {}).get("lora_rank")
    model_only = "optimizer" not in manifest.get("contents", ["optimizer"]) or starts_lora
    # Expert weights are global tensors too (any EP/ETP loads them). Their optimizer state is a part of its own at
    # every EP since the checkpoints marked "experts_apart" (compat.moe.expert_params_apart); before, EP 1 kept it
    # with the dense parameters, so an older MoE checkpoint's optimizer state moves to no other expert layout.
    same_expert_layout = _expert_layout(saved) == _expert_layout(mine) or not cfg.num_experts  # (dense: none)
    same_model_layout = all(saved[k] == mine[k] for k in ("tp", "pp", "vpp")) and same_expert_layout
    apart = bool(manifest.get("experts_apart"))
    # an older checkpoint of EP 1 / ETP TP kept the experts' state with the dense parameters: it fits no run now
    # (that keeps them apart), except ZeRO-2 (Megatron-FSDP groups experts by name at any EP)
    older_ep1 = bool(cfg.num_experts) and not apart and _expert_layout(saved) == (1, saved["tp"]) and saved["zero"] != 2
    experts_move = (same_expert_layout or (apart and cfg.zero_stage != 2)) and not older_ep1
    # The distributed optimizer's shards follow DP size changes only (dp_reshardable), or any TP/PP/EP when saved
    # fully_reshardable; without ZeRO they follow the model.
    fully = manifest.get("optimizer_sharding") == "fully_reshardable"
    optimizer_fits = saved["zero"] == mine["zero"] and bool(experts_move) and (
        same_model_layout or mine["zero"] == 0 or fully)
    return Restore(model_only, same_model_layout, optimizer_fits,
                   optimizer=optimizer_fits and not model_only and not cfg.no_load_optim, starts_lora=starts_lora)


@dataclass(frozen=True)
class Counting:
    """How a run's learning-rate schedule counts. megatron-core's OptimizerParamScheduler (the engine) counts
    samples and takes --lr-warmup-fraction of the decay; the Hugging Face PreTrainer's LambdaLR counts optimizer
    steps (the same iterations of another --global-batch-size are the same schedule) and takes the fraction of
    --train-iters, as templates/schedule.py's build_scheduler does."""
    per_sample: bool
    warmup_of: str  # what --lr-warmup-fraction is a share of: "the decay" or "--train-iters"

    def warmup_iters(self, cfg: Config) -> int:
        if self.warmup_of == "the decay" or cfg.lr_warmup_fraction is None:
            return cfg.warmup_iters
        return int(round(cfg.lr_warmup_fraction * cfg.train_iters))


ENGINE = Counting(per_sample=True, warmup_of="the decay")
HF = Counting(per_sample=False, warmup_of="--train-iters")
HF_FORMAT = "hf_dcp"  # checkpoint.json's "format" of a Hugging Face PreTrainer (templates/checkpoint_hf.FORMAT)


def counting(manifest: Dict) -> Counting:
    """How the schedule stored in `manifest` counts (from the checkpoint's format)."""
    return HF if manifest.get("format") == HF_FORMAT else ENGINE


def scheduler_settings(cfg: Config, count: Counting = ENGINE) -> Dict:
    """megatron-core OptimizerParamScheduler's settings for this run, counted in samples as it stores them (the
    Hugging Face PreTrainer stores the same keys for its own schedule, `count` HF)."""
    gbs = cfg.global_batch_size
    return dict(max_lr=float(cfg.lr), min_lr=float(cfg.min_lr), lr_warmup_steps=count.warmup_iters(cfg) * gbs,
                lr_decay_steps=cfg.decay_iters * gbs, lr_decay_style=cfg.lr_decay_style,
                start_wd=float(cfg.weight_decay), end_wd=float(cfg.weight_decay), wd_incr_steps=cfg.train_iters * gbs,
                wd_incr_style="constant")


def _iters(samples: int, gbs: int) -> str:
    return f"{samples // gbs}" if samples % gbs == 0 else f"{samples / gbs:g}"


def schedule_conflicts(cfg: Config, manifest: Dict) -> List[str]:
    """How this run's schedule flags differ from the schedule stored in `manifest` (empty: they agree)."""
    stored, old_cfg = manifest["scheduler"], manifest.get("config", {})
    count = counting(manifest)
    new = scheduler_settings(cfg, count)
    gbs = cfg.global_batch_size
    old_gbs = old_cfg.get("global_batch_size") or gbs
    out = []
    for key, flag in (("max_lr", "--lr"), ("min_lr", "--min-lr"), ("start_wd", "--weight-decay")):
        if key in stored and float(stored[key]) != new[key]:
            out.append(f"{flag} {stored[key]:g} in the checkpoint, {new[key]:g} here")
    if stored["lr_decay_style"] != new["lr_decay_style"]:
        out.append(f"--lr-decay-style {stored['lr_decay_style']} in the checkpoint, {new['lr_decay_style']} here")
    for key, what, here, flag in (
            ("lr_decay_steps", "lr decay over", cfg.decay_iters,
             f"--lr-decay-iters {cfg.lr_decay_iters}" if cfg.lr_decay_iters
             else f"--train-iters {cfg.train_iters} (--lr-decay-iters defaults to it)"),
            ("lr_warmup_steps", "warmup", count.warmup_iters(cfg),
             f"--lr-warmup-fraction {cfg.lr_warmup_fraction:g} of {count.warmup_of}"
             if cfg.lr_warmup_fraction is not None else f"--lr-warmup-iters {cfg.lr_warmup_iters}")):
        # samples (megatron-core), or optimizer steps: the stored samples over the checkpoint's global batch
        same = stored[key] == new[key] if count.per_sample else stored[key] * gbs == new[key] * old_gbs
        if same:
            continue
        there = _iters(stored[key], old_gbs)
        if old_gbs != gbs and there == str(here):  # same iterations, other batch: the schedule counts samples
            out.append(f"{what} {there} iterations of {old_gbs} samples in the checkpoint, of {gbs} samples here: "
                       f"--global-batch-size {gbs}")
        else:
            out.append(f"{what} {there} iterations in the checkpoint, {here} here: {flag}")
    if not out and _past_decay(cfg, manifest):
        out.append(f"--train-iters {cfg.train_iters} runs past the end of the checkpoint's lr decay (iteration "
                   f"{cfg.decay_iters}, where its run of --train-iters {old_cfg['train_iters']} ended): iterations "
                   f"{cfg.decay_iters + 1}-{cfg.train_iters} would train at --min-lr {cfg.min_lr:g}")
    return out


def _past_decay(cfg: Config, manifest: Dict) -> bool:
    """True when the schedule is the checkpoint's but this run goes on after its decay, where the checkpoint's run
    ended with it: --train-iters is not a scheduler field, and the extra iterations would train at --min-lr (0 by
    default). A run planned past its decay (--lr-decay-iters below --train-iters) may be extended."""
    stored, old_cfg = manifest["scheduler"], manifest.get("config", {})
    gbs, old_train = cfg.global_batch_size, old_cfg.get("train_iters")
    if cfg.lr_decay_style == "constant" or old_train is None or cfg.train_iters == old_train:
        return False
    old_ended_with_decay = old_train * (old_cfg.get("global_batch_size") or gbs) <= stored["lr_decay_steps"]
    return old_ended_with_decay and cfg.train_iters * gbs > scheduler_settings(cfg)["lr_decay_steps"]


def check_schedule(cfg: Config, manifest: Dict, where: str) -> Optional[str]:
    """The refusal (one line) of resuming the checkpoint `where` with this run's schedule flags, or None."""
    if not manifest.get("scheduler"):
        return None  # no schedule stored (weights only; a Hugging Face PreTrainer run on its own scheduler)
    if counting(manifest) is ENGINE and not restores(manifest, cfg).optimizer:
        return None  # no schedule is restored (--no-load-optim, another ZeRO layout): nothing to compare
    if cfg.override_opt_param_scheduler or cfg.use_checkpoint_opt_param_scheduler:
        return None
    conflicts = schedule_conflicts(cfg, manifest)
    if not conflicts:
        return None
    it = manifest["iteration"]
    longer = f" and --lr-decay-iters {cfg.train_iters}" if _past_decay(cfg, manifest) else ""
    return (f"{where} (iteration {it}) continues a learning-rate schedule that this run's flags change: "
            f"{'; '.join(conflicts)}. Pass --override-opt-param-scheduler{longer} to continue from iteration {it} with "
            f"this run's schedule, or --use-checkpoint-opt-param-scheduler to keep the checkpoint's")


LAYOUT_NAMES = {"tp": "TP", "pp": "PP", "vpp": "VPP", "dp": "DP", "zero": "ZeRO", "ep": "EP", "etp": "ETP"}


def _word(value) -> str:
    return {True: "on", False: "off", None: "none"}[value] if isinstance(value, bool) or value is None else str(value)


def _differences(cfg: Config, manifest: Dict) -> List[str]:
    """The model fields and layout of `manifest`'s run that differ from this run's, as 'flag X there, Y here'."""
    stored = manifest.get("config", {})
    out = []
    for key in ARCHITECTURE:
        mine = getattr(cfg, key)
        if key in stored and mine is not None and stored[key] != mine:
            out.append(f"{FLAG.get(key, '--' + key.replace('_', '-'))} {_word(stored[key])} there, {_word(mine)} here")
    saved, mine = manifest.get("layout", {}), layout(cfg)
    for key, name in LAYOUT_NAMES.items():
        if (key in saved) == (key in mine) and saved.get(key) != mine.get(key):  # EP/ETP: experts on both sides
            out.append(f"{name} {saved.get(key, '-')} there, {mine.get(key, '-')} here")
    return out


def check_save(cfg: Config) -> Optional[str]:
    """The refusal (one line) of writing into a --save directory that holds another run's checkpoints, or None."""
    from . import checkpoint_layout as directory  # torch-free: the on-disk layout only

    save = cfg.save
    if not save or cfg.skip_train:  # --skip-train only evaluates: it writes no checkpoint
        return None
    if cfg.load and os.path.realpath(cfg.load) == os.path.realpath(save):
        return None  # resuming in place: the run continues its own checkpoints
    if not directory.iterations_on_disk(save) and not os.path.exists(os.path.join(save, directory.TRACKER)):
        return None  # empty, or only the leftovers of an interrupted save (pruned by the next save)
    found = newest_manifest(save)
    if found is None:
        what = "checkpoints"
    else:
        iteration, manifest = found
        diffs = _differences(cfg, manifest)
        what = (f"the checkpoints of another run (iteration {iteration}; {', '.join(diffs)})" if diffs else
                f"checkpoints of this model and layout (iteration {iteration})")
    return (f"--save {save} already holds {what}: a run never writes over another run's checkpoints. Resume that "
            f"run with --load {save}, or choose a new --save directory (pretrain_scripts/run_gpt.sh: OUTPUT=DIR)")


def check_scheduler_flags(cfg: Config, loads_schedule: bool, why: str) -> None:
    """Refuse (ConfigError, one line) both scheduler flags at once, or either where no schedule is loaded (`why`
    says why not)."""
    override, keep = cfg.override_opt_param_scheduler, cfg.use_checkpoint_opt_param_scheduler
    if override and keep:
        raise ConfigError("--override-opt-param-scheduler takes this run's schedule, "
                          "--use-checkpoint-opt-param-scheduler the checkpoint's: pass only one")
    if (override or keep) and not loads_schedule:
        flag = "--override-opt-param-scheduler" if override else "--use-checkpoint-opt-param-scheduler"
        raise ConfigError(f"{flag}: {why}; drop the flag")


def check_resume(cfg: Config) -> None:
    """validate()'s checks of --load / --save and the scheduler flags against the checkpoints on disk."""
    check_scheduler_flags(cfg, bool(cfg.load) and not cfg.no_load_optim,
                          "--no-load-optim loads no schedule" if cfg.load else "it applies when resuming with --load")
    refusal = check_save(cfg)
    if refusal:
        raise ConfigError(refusal)
    if cfg.load:
        found = newest_manifest(cfg.load)
        refusal = found and check_schedule(cfg, found[1], f"--load {cfg.load}")
        if refusal:
            raise ConfigError(refusal)
