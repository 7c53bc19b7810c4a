"""Writing a checkpoint the one way both loops do (the engine's `Checkpointer` and the torch loop's
`TorchCheckpointer`): every worker writes its files into `iter_N.tmp/`, rank 0 then writes the manifest as the last
file (its inventory covers them all), renames the directory to `iter_N/` and moves the tracker
(`megatron_patch.config.checkpoint_layout`), so a crash leaves the previous checkpoint or the new one complete."""
from __future__ import annotations

import os
import shutil
from typing import Callable, Dict, Optional

import torch.distributed as dist

from megatron_patch.config import checkpoint_layout as directory
from megatron_patch.config.checkpoint_layout import checkpoint_dir


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def write_checkpoint(root: str, iteration: int, write_files: Callable[[str], None], manifest: Callable[[], Dict],
                     keep_last_n: Optional[int] = None) -> str:
    """Publish checkpoint `iteration` under `root` (collective: every worker calls it) and return its directory.
    `write_files(tmp)`: this worker's files; `manifest()`: checkpoint.json's entries (called on rank 0 once every
    worker's files are written); `keep_last_n`: prune older complete checkpoints afterwards."""
    write_files(begin_checkpoint(root, iteration))
    return publish_checkpoint(root, iteration, manifest, keep_last_n)


def begin_checkpoint(root: str, iteration: int) -> str:
    """The first half of `write_checkpoint` (collective): a fresh `iter_N.tmp/`, returned."""
    tmp = checkpoint_dir(root, iteration) + ".tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that died
        os.makedirs(tmp)
    _barrier()
    return tmp


def publish_checkpoint(root: str, iteration: int, manifest: Callable[[], Dict],
                       keep_last_n: Optional[int] = None) -> str:
    """The second half (collective), once every worker's files are in `iter_N.tmp/` (an asynchronous save calls it
    when its writes are done): the manifest, the rename, the tracker, the pruning."""
    tmp = checkpoint_dir(root, iteration) + ".tmp"
    _barrier()  # every worker's files are written: the manifest's inventory covers them
    if _rank() == 0:
        directory.write_manifest(tmp, manifest())
        directory.publish(tmp, root, iteration)  # iter_N.tmp -> iter_N, then the tracker
        if keep_last_n:
            directory.prune(root, keep_last_n)
    _barrier()
    return checkpoint_dir(root, iteration)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
