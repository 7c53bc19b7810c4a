"""The `rapidformer` console script: parse, check the front end's rules, the model and the data, start the
workers."""
from __future__ import annotations

import sys
from typing import List, Optional

from megatron_patch.config.rapidformer_flags import UsageError, parse_args

from .launch import nodes, run_workers, workers_per_node
from .preflight import check_data, check_model, check_padding_free, check_shapes, offline


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    offline()
    try:
        # the model and the data first: neither check imports torch, so a mistake there is reported at once
        check_model(args)
        check_data(args)
        from megatron_patch.compat.quiet import quiet_known_noise  # imports torch: after the quick checks

        from megatron_patch.templates.rules import check  # the templates import torch too

        quiet_known_noise()  # this process may run the single worker itself
        nproc = workers_per_node(args.nproc_per_node)
        if (args.max_restarts or 0) < 0:
            raise UsageError(f"--max-restarts {args.max_restarts}: give 0 or more restarts")
        check(args, world_size=nproc * nodes())
        check_shapes(args)
        check_padding_free(args)
    except (UsageError, ValueError) as e:  # FinetuneDataError and the data checks' DataError are ValueErrors
        print(f"rapidformer: error: {e}", file=sys.stderr)
        return 2
    return run_workers(argv, nproc, args)


if __name__ == "__main__":
    sys.exit(main())
