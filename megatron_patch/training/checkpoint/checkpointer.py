"""`Checkpointer`: when to save, how to save and load, and which checkpoint to resume from."""
from __future__ import annotations

import pickle
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_patch.compat import apply_safe_loading, safe_loading
from megatron_patch.compat.optimizer import set_param_group_lr_range
from megatron_patch.config import Config
from megatron_patch.config import checkpoint_layout as directory
from megatron_patch.config.checkpoint_layout import CheckpointError, checkpoint_dir
from megatron_patch.config.resume import at_saved_layout, bound_to_saved_layout, check_schedule, layout, restores

from . import fsdp_dtensor, torch_dist
from .atomic import begin_checkpoint, publish_checkpoint, write_checkpoint
from .state import SaveSchedule, TrainState

BACKENDS = {torch_dist.FORMAT: torch_dist, fsdp_dtensor.FORMAT: fsdp_dtensor}


def _versions() -> Dict[str, str]:
    import megatron.core

    import megatron_patch

    return {"torch": torch.__version__, "megatron_core": getattr(megatron.core, "__version__", "?"),
            "megatron_patch": getattr(megatron_patch, "__version__", "?")}


def _print0(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


class Checkpointer(SaveSchedule):
    """Saves and loads the whole training state under --save / --load.

    `should_save(iteration)` says when (every --save-interval, and when training stops); `save(state)`
    writes a checkpoint (collective) and prunes to --keep-last-n; `load()` resumes from --load
    (`load_weights(path)`: the model weights of one checkpoint only, as conversion's verify loads them). The
    backend follows the run: megatron-core dist_checkpointing (ZeRO-0/1) or Megatron-FSDP's DTensors
    (ZeRO-2). Each checkpoint stores the run's configuration (model arguments included) in its
    checkpoint.json. `--save` is checked writable and `--load` checked to exist by Config.validate, before launch.
    """

    def __init__(self, cfg: Config, model: List, optimizer, scheduler, model_info: Optional[Dict] = None) -> None:
        super().__init__(cfg.save, cfg.save_interval)
        self.cfg, self.model, self.optimizer, self.scheduler = cfg, model, optimizer, scheduler
        self.model_info = model_info or {}
        apply_safe_loading()
        self.format = fsdp_dtensor.FORMAT if cfg.zero_2_memory_optimization else torch_dist.FORMAT
        self.backend = BACKENDS[self.format]
        # the distributed optimizer's format, recorded in the manifest: ZeRO-1's choice (torch_dist.py); ZeRO-2
        # checkpoints are fully reshardable since SwiGLU's fc1 is stored split (fsdp_dtensor.py)
        self.optim_sharding = {1: torch_dist.FULLY_RESHARDABLE if cfg.dist_ckpt_optim_fully_reshardable
                               else torch_dist.DP_RESHARDABLE, 2: fsdp_dtensor.FULLY_RESHARDABLE}.get(cfg.zero_stage)
        self.async_saver = None
        if cfg.async_save and cfg.save:
            from .async_save import AsyncSaver

            self.async_saver = AsyncSaver()

    def save(self, state: TrainState, consume_model: bool = False, root: Optional[str] = None) -> str:
        """Write checkpoint `state.iteration` under --save; collective (every rank calls it).
        `consume_model`: the model is not used after this (a conversion); its memory may be freed while saving.
        `root`: write under this directory instead, which becomes --save later (a conversion's staging
        directory, renamed once verified); the stored configuration still names --save.
        With --async-save the files are written in the background (see async_save.py) and the directory is
        published later (poll(), finish()); it is returned all the same."""
        root = root or self.cfg.save
        model_only = self.optimizer is None
        entries = lambda: {**state.saved(), "format": self.format, "layout": layout(self.cfg),  # noqa: E731
                           "contents": ["model"] if model_only else ["model", "optimizer", "rng", "scheduler"],
                           "scheduler": None if model_only else self.scheduler.state_dict(),
                           "config": self.cfg.to_flat(), "model": self.model_info, "versions": _versions(),
                           **({"optimizer_sharding": self.optim_sharding} if self.optim_sharding and not model_only
                              else {}),
                           # the experts' optimizer state is a part of its own at every EP (compat.moe)
                           **({"experts_apart": True} if self.cfg.num_experts and self.cfg.zero_stage != 2 else {})}
        self.last_saved = state.iteration
        if self.async_saver is not None and not consume_model:
            return self._save_async(state.iteration, root, entries())  # the entries as of this iteration
        final = write_checkpoint(
            root, state.iteration,
            lambda tmp: self.backend.save(tmp, self.model, self.optimizer, consume_model=consume_model,
                                          **self._sharding(self.optim_sharding)),
            entries, self.cfg.keep_last_n)
        _print0(f"saved checkpoint {final}")
        return final

    def _save_async(self, iteration: int, root: str, entries: Dict) -> str:
        self.finish()  # one save in flight: the previous one is published first
        t0 = time.time()
        request = self.backend.save_async(begin_checkpoint(root, iteration), self.model, self.optimizer,
                                          **self._sharding(self.optim_sharding))

        def publish() -> str:
            return publish_checkpoint(root, iteration, lambda: entries, self.cfg.keep_last_n)

        self.async_saver.start(iteration, request, publish)
        _print0(f"checkpoint {checkpoint_dir(root, iteration)}: planned and staged in {time.time() - t0:.2f} s, "
                "writing in the background (--async-save)")
        return checkpoint_dir(root, iteration)

    def _sharding(self, optim_sharding: Optional[str]) -> Dict:
        """The backend's keyword for the distributed optimizer's format."""
        return {"optim_sharding": optim_sharding} if optim_sharding else {}

    def poll(self) -> None:
        """--async-save: publish the checkpoint being written once every rank has written its files (collective;
        after every iteration). A no-op otherwise."""
        if self.async_saver is not None and self.async_saver.pending is not None:
            self._published(self.async_saver.pending.started, self.async_saver.poll())

    def finish(self) -> None:
        """--async-save: wait for the checkpoint being written and publish it (collective; at the end of training).
        A no-op otherwise."""
        if self.async_saver is not None and self.async_saver.pending is not None:
            self._published(self.async_saver.pending.started, self.async_saver.finish())

    @staticmethod
    def _published(started: float, final: Optional[str]) -> None:
        if final is not None:
            _print0(f"saved checkpoint {final} (written in the background, published {time.time() - started:.1f} s "
                    "after it started)")

    def load(self) -> Optional[TrainState]:
        """Restore the newest complete checkpoint under --load; None when the directory holds none."""
        root = self.cfg.load
        iteration, warnings = directory.select_checkpoint(root)
        for w in warnings:
            _print0(w)
        if iteration is None:
            _print0(f"no checkpoint in --load {root} (no {directory.TRACKER}, no iter_* directory): starting from scratch")
            return None
        path = checkpoint_dir(root, iteration)
        manifest = directory.read_manifest(path)
        saved, mine = manifest["layout"], layout(self.cfg)
        self._check_loadable(path, manifest)
        restore = restores(manifest, self.cfg)
        model_only, same_model_layout = restore.model_only, restore.same_model_layout
        optimizer_fits, load_optimizer = restore.optimizer_fits, restore.optimizer
        refusal = check_schedule(self.cfg, manifest, path)  # validate() refused it already; a caller may not validate
        if refusal:
            raise CheckpointError(refusal)
        stored = manifest.get("scheduler") or {}
        if load_optimizer:  # the saved param groups are found by their lr range: give the groups the checkpoint's
            set_param_group_lr_range(self.optimizer, stored["max_lr"], stored["min_lr"])
        self._read(path, manifest, load_optimizer=load_optimizer, load_rng=same_model_layout and not model_only,
                   without_adapters=restore.starts_lora)
        notes = []
        if load_optimizer:
            self.scheduler.load_state_dict(stored)  # megatron-core: the step count, and the settings that win
            set_param_group_lr_range(self.optimizer, self.scheduler.max_lr, self.scheduler.min_lr)
            self.scheduler.step(0)  # the groups' lr from that range
            if self.cfg.override_opt_param_scheduler:
                notes.append("lr schedule: this run's flags (--override-opt-param-scheduler), from the checkpoint's step")
            elif self.cfg.use_checkpoint_opt_param_scheduler:
                notes.append(f"lr schedule: the checkpoint's (--use-checkpoint-opt-param-scheduler: --lr "
                             f"{self.scheduler.max_lr:g}, decay over {self.scheduler.lr_decay_steps} samples)")
        if saved != mine:
            notes.append(f"layout {saved} -> {mine}")
        if not same_model_layout:
            notes.append("weights resharded, RNG streams start fresh (they depend on TP/PP)")
        if model_only:
            notes.append("it holds weights only (e.g. converted from Hugging Face): optimizer, lr schedule and RNG "
                         "start fresh")
        elif not optimizer_fits and not self.cfg.no_load_optim:
            notes.append("the optimizer state does not fit this layout (ZeRO-1 state moves between DP sizes only, unless "
                         "saved with --dist-ckpt-optim-fully-reshardable, not between ZeRO stages, and an MoE checkpoint "
                         "written before the experts' state was kept apart moves to no other expert layout): optimizer and lr schedule start fresh")
        if restore.starts_lora:
            _print0(f"loaded the base weights of {path} (iteration {iteration}) for LoRA: adapters, optimizer, "
                    f"learning-rate schedule and data start fresh at iteration 0")
            self.model_info = {**manifest.get("model", {}), **self.model_info, "lora_base": path}
            return TrainState()
        _print0(f"loaded checkpoint {path} (iteration {iteration})" + ("; " + "; ".join(notes) if notes else ""))
        self.last_saved = iteration if root == self.cfg.save else None
        self.model_info = {**manifest.get("model", {}), **self.model_info}  # keeps e.g. the Hugging Face origin
        return TrainState(manifest["iteration"], manifest["consumed_samples"], manifest.get("consumed_valid_samples", 0))

    def load_weights(self, path: str) -> Dict:
        """Only the model weights of checkpoint `path` (an iter_XXXXXXX directory) into this run's model, resharded
        to its layout as resuming would (the same checks, format and backend): no optimizer state, RNG streams or
        learning-rate schedule. Conversion's verify builds its engine model this way, independent of the reader that
        exports. Returns the checkpoint's manifest. Collective."""
        manifest = directory.read_manifest(path)
        self._check_loadable(path, manifest)
        self._read(path, manifest, load_optimizer=False, load_rng=False,
                   without_adapters=restores(manifest, self.cfg).starts_lora)
        return manifest

    def _check_loadable(self, path: str, manifest: Dict) -> None:
        """Refuse, in words, a checkpoint this run's backend cannot load into its layout."""
        saved, mine = manifest["layout"], layout(self.cfg)
        if manifest["format"] != self.format:
            wanted = "--zero-2-memory-optimization" if manifest["format"] == fsdp_dtensor.FORMAT else \
                "ZeRO-0 or --zero-1-memory-optimization"
            raise CheckpointError(f"{path} was written by a {'ZeRO-2' if saved['zero'] == 2 else 'ZeRO-0/1'} run "
                                  f"({manifest['format']} format); resume it with {wanted}")
        if bound_to_saved_layout(manifest) and not at_saved_layout(manifest, mine):
            # an older ZeRO-2 checkpoint: its SwiGLU fc1 interleaves the TP ranks' halves (fsdp_dtensor.py)
            raise CheckpointError(f"{path} is a ZeRO-2 checkpoint of layout {saved}, written before ZeRO-2 checkpoints "
                                  f"became fully reshardable; it loads into the same TP/PP/EP at any DP size (this "
                                  f"run: {mine}). Resume with TP {saved['tp']}, PP {saved['pp']} and ZeRO-2.")

    def _read(self, path: str, manifest: Dict, load_optimizer: bool, load_rng: bool, without_adapters: bool) -> None:
        """The backend's load of `path`, its pickled objects through the safe-loading allow-lists."""
        try:
            safe_loading.check_metadata(path)  # DCP itself would swallow the refusal into "metadata is None"
            self.backend.load(path, self.model, self.optimizer, load_optimizer=load_optimizer, load_rng=load_rng,
                              without_adapters=without_adapters,
                              **self._sharding(manifest.get("optimizer_sharding", torch_dist.DP_RESHARDABLE)))
        except (pickle.UnpicklingError, CheckpointException) as e:
            refused = directory.refused_unpickling(e)  # raised by the safe-loading patches (megatron_patch.compat.safe_loading)
            if refused is None:
                raise
            raise CheckpointError(f"{path}: {refused} Loading a checkpoint never runs code that it contains; this one "
                                  f"was not written by megatron_patch or has been tampered with.") from None
