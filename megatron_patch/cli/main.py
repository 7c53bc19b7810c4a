"""The `rapidformer` console script: parse, check the front end's rules, start the workers."""
from __future__ import annotations

import sys
from typing import List, Optional

from megatron_patch.compat.quiet import quiet_known_noise

from .arguments import UsageError, parse_args
from .launch import nodes, run_workers, workers_per_node
from .rules import check


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_known_noise()  # this process runs the single worker itself
    args = parse_args(argv)
    try:
        nproc = workers_per_node(args.nproc_per_node)
        check(args, world_size=nproc * nodes())
    except (UsageError, ValueError) as e:
        print(f"rapidformer: error: {e}", file=sys.stderr)
        return 2
    return run_workers(argv, nproc)


if __name__ == "__main__":
    sys.exit(main())
