"""Checkpoints: the `Checkpointer` component, its on-disk layout, RNG capture, and one backend per format."""
from .checkpointer import Checkpointer, TrainState, layout
from .directory import CheckpointError, checkpoint_dir, read_manifest, read_tracker

__all__ = ["Checkpointer", "TrainState", "CheckpointError", "checkpoint_dir", "layout", "read_manifest", "read_tracker"]
