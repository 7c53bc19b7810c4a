"""The front end's rules that need to know what the user's script built (concerns of the front end's table,
table.py): "pretrainer" runs when PreTrainer.train() starts (the script is a pretraining one, whatever
--task says). A Megatron model's rules are in megatron_model.py; the flags a Hugging Face model cannot use (such
as tensor/pipeline parallelism) are refused by config/flag_use.py's table once the model says its kind."""
from __future__ import annotations

import argparse
from typing import Optional

from .table import front_rule


@front_rule("pretrainer")
def iteration_based(args: argparse.Namespace, world_size: int) -> Optional[str]:
    if not args.train_iters:
        return "pretraining is iteration-based: give --train-iters N (--epochs is for fine-tuning)"

