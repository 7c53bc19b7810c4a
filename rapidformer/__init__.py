"""`from rapidformer import ...`: the public API of the Rapidformer front end, as the how-to imports it: the
templates (`Finetuner`, `PreTrainer`, alias `Pretrainer`), `RapidformerEngine`, the run's globals, and what the
pretraining samples call (`mpu` with `broadcast_data`, `get_tokenizer`, `get_ltor_masks_and_position_ids`,
`build_train_valid_test_datasets`, `build_train_valid_test_datasets_for_huggingface`)."""
from megatron_patch.templates import Finetuner, RapidformerEngine, get_args, get_logger, get_timers
from megatron_patch.templates import mpu
from megatron_patch.templates.gpt_samples import build_train_valid_test_datasets, get_ltor_masks_and_position_ids
from megatron_patch.templates.pretrainer import PreTrainer
from megatron_patch.templates.pretraining_data import build_train_valid_test_datasets_for_huggingface, get_tokenizer

Pretrainer = PreTrainer

__all__ = ["RapidformerEngine", "Finetuner", "PreTrainer", "Pretrainer", "get_args", "get_logger", "get_timers", "mpu",
           "get_tokenizer", "get_ltor_masks_and_position_ids", "build_train_valid_test_datasets",
           "build_train_valid_test_datasets_for_huggingface"]
