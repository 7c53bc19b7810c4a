"""Checkpoints: the `Checkpointer` component, its on-disk layout, RNG capture, and one backend per format.

The layout (reading manifests, choosing the checkpoint to load) lives in `megatron_patch.config.checkpoint_layout`:
it needs neither torch nor megatron-core, so the configuration layer reads a checkpoint's stored settings before
any of them is imported; so does `state` (TrainState, SaveSchedule); the rest is imported on first use."""
from megatron_patch.config.checkpoint_layout import CheckpointError, checkpoint_dir, read_manifest, read_tracker

from .state import SaveSchedule, TrainState

__all__ = ["Checkpointer", "TrainState", "SaveSchedule", "CheckpointError", "checkpoint_dir", "layout",
           "read_manifest", "read_tracker"]


def __getattr__(name: str):
    if name in ("Checkpointer", "layout"):
        from . import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(name)
