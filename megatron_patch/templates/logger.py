"""The `rapidformer` logger (INFO on rank 0, warnings and errors everywhere), in a module of its own: the flag
rules and the engine configuration log through it without importing the run's globals (get_args), which run
those rules."""
from __future__ import annotations

import logging
import os
import sys


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return rank() == 0 or record.levelno >= logging.WARNING


def get_logger() -> logging.Logger:
    """The `rapidformer` logger: INFO on rank 0, warnings and errors on every rank."""
    logger = logging.getLogger("rapidformer")
    if not logger.handlers:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
        h.addFilter(_RankFilter())
        logger.addHandler(h)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
