"""The engine's rules: one table of small named checks, grouped by concern, each returning its refusal (a sentence
naming the flags and the fix) or None. `run_checks` runs them in table order on a resolved Config and raises the
first refusal. They read the configuration only (and whether a GPU / Triton is there), never the file system: the
checks of --save and --load against the disk are validate.py's `check_paths`, run by the entry point."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

# Import order registers the concerns' tables in this order: layout, moe, batch, memory, precision, fusion,
# schedule, model, data, checkpoint, then BERT's (model, bert_pretraining).
from . import checks_layout, checks_training, checks_bert  # noqa: F401  (they register their checks, in this order)
from .errors import ConfigError
from .rule import CHECKS, Check  # noqa: F401  (re-exported: the table)

if TYPE_CHECKING:
    from .config import Config


# Concerns of one entry point: run only when it names them (pretrain_megatron_bert.py: BERT pretraining's data)
ENTRY_CONCERNS = ("bert_pretraining",)


def run_checks(c: Config, concerns: Optional[tuple] = None) -> None:
    """Raise ConfigError with the first refusal of the table (of `concerns`; default every concern but the entry
    points' own, ENTRY_CONCERNS) for `c`."""
    if concerns is not None:
        CHECKS.run(c, which=lambda concern: concern in concerns, error=ConfigError)
    else:
        CHECKS.run(c, which=lambda concern: concern not in ENTRY_CONCERNS, error=ConfigError)
