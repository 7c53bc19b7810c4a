"""The front end's rules for a Megatron model (a PreTrainer whose model is megatron_patch.models.GPTModel(), or
--task pretraining of one): the switches such a model cannot use, refused in words. They run where the model says
what it is (templates/engine_config.py), concern "megatron_model" of the front end's table."""
from __future__ import annotations

import argparse
from typing import Optional

from .table import front_rule

# Hugging Face-only sharding switches: the Megatron engine shards with ZeRO-1/2 (its distributed optimizer,
# Megatron-FSDP)
HF_ONLY = ("oss_memory_optimization", "oss_sdp_memory_optimization", "fsdp_memory_optimization")


@front_rule("megatron_model")
def no_onnx_runtime(args: argparse.Namespace, world_size: int) -> Optional[str]:
    if getattr(args, "onnx_runtime_training", False):
        return ("--onnx-runtime-training: ONNX Runtime's ORTModule trains Hugging Face/PyTorch models "
                "(one exported graph per model); a megatron-core model trains with the engine's own "
                "tensor/pipeline-parallel schedules, which ORTModule cannot export: drop the flag, or "
                "use --torch-compile, the engine's graph optimizer")


@front_rule("megatron_model")
def engine_sharding(args: argparse.Namespace, world_size: int) -> Optional[str]:
    used = [f"--{n.replace('_', '-')}" for n in HF_ONLY if getattr(args, n, False)]
    if used:
        return (f"{', '.join(used)}: a Hugging Face acceleration; a Megatron model is sharded with "
                "--zero-1-memory-optimization (distributed optimizer) or --zero-2-memory-optimization "
                "(Megatron-FSDP): use one of those")


@front_rule("megatron_model")
def fixed_shapes(args: argparse.Namespace, world_size: int) -> Optional[str]:
    if getattr(args, "data_iterator", None) == "dynamic-shape":
        return ("--data-iterator dynamic-shape: a Megatron model's pipeline sends activations of a fixed "
                "--seq-length between stages, and GPT samples are packed to it with no padding to cut; "
                "drop the flag (it applies to Hugging Face models on padded BERT-style samples)")
