"""How a worker's usage error reaches the `rapidformer` command: one `rapidformer: error: ...` line, exit 2.

torchrun exits 1 whenever a worker fails, whatever the worker's own status, and prints a ChildFailedError
traceback. So the launcher (launch.run_workers) gives its workers a status directory (RAPIDFORMER_STATUS_DIR);
a worker that meets a usage error writes its message there, one file per rank, and exits 0, which keeps
torchrun quiet. Once torchrun has returned, the launcher prints the message of the lowest rank, once, and
returns 2. A worker started another way (in this process for a single worker, or by the user's own torchrun)
prints the message on rank 0 and returns 2 itself.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

CHECKED_ARGS = "RAPIDFORMER_CHECKED_ARGS"  # the file of the flags the launching process checked (worker.py)
ENV = "RAPIDFORMER_STATUS_DIR"
USAGE_ERROR = 2


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def report_usage_error(error: Exception) -> int:
    """In a worker: report `error` (a mistake in the flags or the data, whose message names the fix) as the
    paragraph above says; returns the worker's exit status."""
    directory = os.environ.get(ENV)
    if directory and os.path.isdir(directory):
        path = os.path.join(directory, f"rank{_rank()}")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(str(error))
        os.replace(path + ".tmp", path)  # the launcher never reads half a message
        return 0
    if _rank() == 0:
        print(f"rapidformer: error: {error}", file=sys.stderr, flush=True)
    return USAGE_ERROR


def first_usage_error(directory: str) -> Optional[str]:
    """In the launcher, after the workers ended: the message of the lowest rank that reported one, or None."""
    reports = []
    for name in os.listdir(directory):
        if name.startswith("rank") and name[4:].isdigit():
            reports.append((int(name[4:]), os.path.join(directory, name)))
    if not reports:
        return None
    with open(min(reports)[1], encoding="utf-8") as f:
        return f.read()
