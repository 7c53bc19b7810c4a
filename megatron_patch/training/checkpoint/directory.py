"""The on-disk layout of a checkpoint directory: moved to `megatron_patch.config.checkpoint_layout` (the
configuration layer reads a checkpoint's manifest before torch is imported, and may not import from training).
This name stays for the code and scripts that import it from here."""
from megatron_patch.config.checkpoint_layout import *  # noqa: F401,F403
from megatron_patch.config.checkpoint_layout import MANIFEST, TRACKER, CheckpointError  # noqa: F401
