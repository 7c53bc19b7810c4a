"""`from rapidformer import ...`: the public API of the Rapidformer front end, as the how-to imports it.

`PreTrainer` (alias `Pretrainer`) and `build_train_valid_test_datasets_for_huggingface` belong to the
pretraining templates; importing them works, using them before they exist says so.
"""
from megatron_patch.templates import Finetuner, RapidformerEngine, get_args, get_logger, get_timers
from megatron_patch.templates.pretrainer import PreTrainer, build_train_valid_test_datasets_for_huggingface

Pretrainer = PreTrainer

__all__ = ["RapidformerEngine", "Finetuner", "PreTrainer", "Pretrainer", "get_args", "get_logger", "get_timers",
           "build_train_valid_test_datasets_for_huggingface"]
