"""Starting the workers: `rapidformer` runs torchrun underneath, so the user never calls it.

One worker per visible GPU (CUDA_VISIBLE_DEVICES), or `--nproc-per-node N`; on a machine without a GPU one
worker, gloo between several. Several nodes use the documented MASTER_ADDR, MASTER_PORT, NNODES and
NODE_RANK. A single worker on a single node runs in this process (no launcher to pay for), unless --max-restarts asks
for torchrun's restarts.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import List

from megatron_patch.ports import free_port

from . import status

CHECKED_ARGS = status.CHECKED_ARGS


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nodes() -> int:
    return int(os.environ.get("NNODES", "1"))


def workers_per_node(requested: int | None) -> int:
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--nproc-per-node {requested}: give 1 or more")
        return requested
    return max(1, visible_gpus())


def torchrun_command(argv: List[str], nproc: int, max_restarts: int = 0) -> List[str]:
    multi_node = nodes() > 1
    port = os.environ.get("MASTER_PORT") or (None if multi_node else str(free_port()))
    if multi_node and not (os.environ.get("MASTER_ADDR") and port):
        raise ValueError("NNODES > 1: set MASTER_ADDR and MASTER_PORT (the first node's address and a free port) "
                         "and NODE_RANK on every node")
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={nodes()}",
            f"--node-rank={os.environ.get('NODE_RANK', '0')}",
            f"--master-addr={os.environ.get('MASTER_ADDR', '127.0.0.1')}", f"--master-port={port}",
            *([f"--max-restarts={max_restarts}"] if max_restarts else []), "-m", "megatron_patch.cli.worker", *argv]


def run_workers(argv: List[str], nproc: int, args) -> int:
    """Run the workers for `argv`, whose flags the front end's rules made `args`, and return the exit status: 2
    when they stopped at a usage error (its message printed once, see status.py), else theirs. The workers get
    `args` as they are (a file named by CHECKED_ARGS), not the rules again."""
    max_restarts = getattr(args, "max_restarts", None) or 0
    if nproc == 1 and nodes() == 1 and not max_restarts:  # (restarts need torchrun's agent, even for one worker)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        from .worker import run

        return run(args, argv)
    from megatron_patch.config.rapidformer_flags import dump_checked

    # OMP_NUM_THREADS: torchrun's own default (1 per worker), set here so that it prints no banner about it
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    with tempfile.TemporaryDirectory(prefix="rapidformer_status_") as directory:
        checked = os.path.join(directory, "checked_args.json")
        dump_checked(args, checked)
        code = subprocess.call(torchrun_command(argv, nproc, max_restarts),
                               env={**env, status.ENV: directory, CHECKED_ARGS: checked})
        message = status.first_usage_error(directory)
    if message is not None:
        print(f"rapidformer: error: {message}", file=sys.stderr, flush=True)
        return status.USAGE_ERROR
    return code
