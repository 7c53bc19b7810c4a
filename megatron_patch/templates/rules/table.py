"""The front end's table of named rules (a `RuleTable`, the engine's frame: config/rule.py): rules register with
`@front_rule(concern)` as a function (args, world_size) -> refusal or None; `run_front` runs those of the concerns
asked for, in table order, and raises the first refusal. The launching process runs the command line's rules
(__init__.py); the rules of a PreTrainer and of the model it built (pretrainer.py, megatron_model.py) run where
the script says what it is."""
from __future__ import annotations

import argparse
from typing import Callable, Type

from megatron_patch.config.rule import RuleTable

FRONT_CHECKS = RuleTable()
front_rule = FRONT_CHECKS.rule  # @front_rule(concern) on a function (args, world_size) -> refusal or None

# concerns whose rules need what the user's script built (pretrainer.py, megatron_model.py): they run there, not
# with the command line's rules
MODEL_CONCERNS = ("pretrainer", "megatron_model")


def run_front(args: argparse.Namespace, world_size: int, which: Callable[[str], bool], error: Type[Exception]) -> None:
    """Raise `error` with the first refusal of the rules whose concern `which` accepts."""
    FRONT_CHECKS.run(args, world_size, which=which, error=error)
