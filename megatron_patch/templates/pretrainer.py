"""The PreTrainer template (pretraining with an iterator of batches) comes with `--task pretraining`; until
then the names import, so the how-to's shared import block works, and using them says what is missing."""
from __future__ import annotations


class PreTrainer:
    """Pretraining template: not available in this version (fine-tuning is: see Finetuner)."""

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("PreTrainer (white-box pretraining) is not available in this version; use "
                                  "Finetuner for fine-tuning, and `bash pretrain_scripts/run_gpt.sh` for Megatron "
                                  "pretraining")


def build_train_valid_test_datasets_for_huggingface(*args, **kwargs):
    raise NotImplementedError("build_train_valid_test_datasets_for_huggingface belongs to the PreTrainer "
                              "(white-box pretraining), not available in this version")
