"""Checkpoints: the `Checkpointer` component, its on-disk layout, RNG capture, and one backend per format.

The layout (reading manifests, choosing the checkpoint to load) lives in `megatron_patch.config.checkpoint_layout`:
it needs neither torch nor megatron-core, so the configuration layer reads a checkpoint's stored settings before
any of them is imported; the rest is imported on first use."""
from megatron_patch.config.checkpoint_layout import CheckpointError, checkpoint_dir, read_manifest, read_tracker

__all__ = ["Checkpointer", "TrainState", "CheckpointError", "checkpoint_dir", "layout", "read_manifest", "read_tracker"]


def __getattr__(name: str):
    if name in ("Checkpointer", "TrainState", "layout"):
        from . import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(name)
