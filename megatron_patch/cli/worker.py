"""What every worker runs: the flags the launching process checked (or, started another way, its own command line
checked by the same rules), then the user's script (white box) or the task's black-box Finetuner."""
from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional

from megatron_patch.compat.quiet import quiet_known_noise
from megatron_patch.templates.globals import get_logger, set_args

from megatron_patch.config.rapidformer_flags import UsageError, load_checked, parse_args
from megatron_patch.templates.rules import check

from .preflight import offline
from .pretrain import destroy_process_groups
from .status import CHECKED_ARGS, report_usage_error


def _user_errors() -> tuple:
    """The exceptions that mean a mistake in the flags or the data (their message names the fix), not a bug: a
    checkpoint that --load cannot use (absent, damaged, tampered with) included."""
    from megatron_patch.config import ConfigError
    from megatron_patch.data.checks import DataError
    from megatron_patch.data.finetune_error import FinetuneDataError
    from megatron_patch.config.checkpoint_layout import CheckpointError

    return UsageError, ConfigError, DataError, FinetuneDataError, CheckpointError


def main(argv: Optional[List[str]] = None) -> int:
    """A worker started by `rapidformer` (torchrun): the flags the launching process checked (CHECKED_ARGS); one
    started another way checks its own command line with the same rules."""
    argv = list(sys.argv[1:] if argv is None else argv)
    offline()
    quiet_known_noise()
    try:
        checked = os.environ.get(CHECKED_ARGS)
        args = (load_checked(checked) if checked else
                check(parse_args(argv), world_size=int(os.environ.get("WORLD_SIZE", "1"))))
    except _user_errors() as e:
        return report_usage_error(e)
    return run(args, argv)


def run(args, argv: List[str]) -> int:
    """Run the user's script or the task with the checked flags `args` (`argv`: the command line they came from,
    which the user's script sees as its sys.argv)."""
    offline()
    quiet_known_noise()
    try:
        _resume_after_restart(args)
        set_args(args)
        log = get_logger()
        for note in args.notes:
            log.info(note)
        if args.user_script:
            sys.argv = [args.user_script, *argv]
            runpy.run_path(args.user_script, run_name="__main__")
            return 0
        from .tasks import run_task

        run_task(args)
        return 0
    except _user_errors() as e:  # every worker meets the same mistake: one line, once (status.py)
        return report_usage_error(e)
    finally:
        destroy_process_groups()


def _resume_after_restart(args) -> None:
    """A restarted attempt (rapidformer --max-restarts) loads the newest complete checkpoint of --save, and rank 0
    says so in one line (config/restart.py)."""
    from megatron_patch.config.restart import restart_resume

    load, line = restart_resume(getattr(args, "save", None))
    if load:
        args.load = load
    if line and int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
