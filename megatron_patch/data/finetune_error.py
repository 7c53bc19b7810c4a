"""The error of the fine-tuning data layer (finetune_data and the modules it uses, task_columns)."""


class FinetuneDataError(ValueError):
    """A fine-tuning dataset cannot be found or used; the message names the flag and the fix."""
