"""The engine's rules: one table of small named checks, grouped by concern, each returning its refusal (a sentence
naming the flags and the fix) or None. `run_checks` runs them in table order on a resolved Config and raises the
first refusal. They read the configuration only (and whether a GPU / Triton is there), never the file system: the
checks of --save and --load against the disk are validate.py's `check_paths`, run by the entry point."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

# Import order registers the concerns' tables in this order: layout, moe, batch, memory, precision, fusion,
# schedule, model, data, checkpoint.
from . import checks_layout, checks_training  # noqa: F401  (they register their checks)
from .errors import ConfigError
from .rule import CHECKS, Check  # noqa: F401  (re-exported: the table)

if TYPE_CHECKING:
    from .config import Config


def run_checks(c: Config, concerns: Optional[tuple] = None) -> None:
    """Raise ConfigError with the first refusal of the table (of `concerns`, default all) for `c`."""
    for check in CHECKS:
        if concerns is None or check.concern in concerns:
            refusal = check.fn(c)
            if refusal:
                raise ConfigError(refusal)

