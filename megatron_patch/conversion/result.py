"""The verdict a conversion worker hands to its parent: one JSON file per process, `rank_<r>.json` in a
directory the parent names (worker.py --status-dir), read back by convert.run_workers. The parent trusts these
files, not torchrun's exit status or log: torchrun turns every failure into exit 1.

Statuses are the command's exit statuses: OK 0, BAD_INPUT 2 (a conversion error: the message says what and
how to fix it), FAILED_VERIFY 3 (the converted model's outputs differ from the original's)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import List

OK, BAD_INPUT, FAILED_VERIFY = 0, 2, 3


@dataclass(frozen=True)
class WorkerResult:
    """One worker process's outcome."""
    rank: int
    status: int  # OK, BAD_INPUT or FAILED_VERIFY
    message: str = ""


def write_result(directory: str, result: WorkerResult) -> None:
    """Write `result` as `directory`/rank_<rank>.json, whole or not at all (renamed into place)."""
    final = os.path.join(directory, f"rank_{result.rank}.json")
    tmp = os.path.join(directory, f".rank_{result.rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(asdict(result), f)
    os.replace(tmp, final)


def read_results(directory: str) -> List[WorkerResult]:
    """Every result written in `directory`, by rank (a worker that died before writing has none)."""
    results = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank_") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                results.append(WorkerResult(**json.load(f)))
    return sorted(results, key=lambda r: r.rank)
