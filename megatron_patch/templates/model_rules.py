"""The front end's rules that need to know what the user's script built (concerns of the front end's table,
front_table.py): "pretrainer" runs when PreTrainer.train() starts (the script is a pretraining one, whatever
--task says), "hf_model" when its model turned out to be a Hugging Face/PyTorch one. A Megatron model's rules
are in megatron_rules.py."""
from __future__ import annotations

import argparse
from typing import Optional

from .front_table import front_rule


@front_rule("pretrainer")
def iteration_based(args: argparse.Namespace, world_size: int) -> Optional[str]:
    if not args.train_iters:
        return "pretraining is iteration-based: give --train-iters N (--epochs is for fine-tuning)"


@front_rule("hf_model")
def no_tensor_or_pipeline_parallel(args: argparse.Namespace, world_size: int) -> Optional[str]:
    tp, pp = args.tensor_model_parallel_size or 1, args.pipeline_model_parallel_size or 1
    if tp > 1 or pp > 1:
        return (f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}: tensor and pipeline "
                "parallelism are for Megatron models (the guide), and model_optimizer_lr_scheduler_provider() "
                "returned a Hugging Face/PyTorch model. Drop the two flags (data parallelism and "
                "--zero-*/--fsdp-memory-optimization shard a Hugging Face model), or build a Megatron model, "
                "e.g. megatron_patch.models.GPTModel()")
