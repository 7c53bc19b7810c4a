"""`engine_config(args)`: the engine's Config for the `rapidformer` flags of a PreTrainer run with a Megatron model
(the flags the engine takes by their own name, the few renamed ones, and the refusals of switches a Megatron model
cannot use)."""
from __future__ import annotations

import argparse

from megatron_patch.config import Config, ConfigError
from megatron_patch.config import flags

from .rules import megatron_model  # noqa: F401  (registers the rules of a Megatron model)
from .rules.table import run_front
from .logger import get_logger

# rapidformer dest -> Config field, for the flags both take (the registry's; a few are renamed: --torch-compile)
_ENGINE_NAME = flags.front_to_engine()


def engine_config(args: argparse.Namespace, accelerations: bool = True) -> Config:
    """The engine's Config for the `rapidformer` flags (not yet validated). `accelerations=False` leaves out the
    switches (ZeRO, precision, recompute, offload, compile): enough to start process groups before the model
    says whether it is a Megatron model."""
    switches = flags.switches()
    values = {}
    for front, key in _ENGINE_NAME.items():
        value = getattr(args, front, None)
        if value is not None and (accelerations or key not in switches):
            values[key] = value
    if isinstance(values.get("data_path"), str):
        values["data_path"] = values["data_path"].split()
    values["lr_warmup_iters"] = values.get("lr_warmup_iters") or 0
    values["data_iterator"] = "fixed-shape"  # checked below for a Megatron model; the HF path has its own
    # Hugging Face templates default --load to the model directory; the engine does not
    if values.get("load") and values["load"] == getattr(args, "pretrained_model_name_or_path", None):
        values.pop("load")
    moe_tp = _moe_tensor_parallel(values)
    cfg = Config(**values)
    if accelerations:
        run_front(args, cfg.world_size, lambda concern: concern == "megatron_model", ConfigError)
        if moe_tp:
            get_logger().info(moe_tp)
        if cfg.fp16 and getattr(args, "mixed_precision", False) and cfg.zero_2_memory_optimization:
            # megatron-core's fp16 loss scaling does not run under Megatron-FSDP: bf16 needs none
            cfg = cfg.replace(precision="bf16")
            get_logger().info("--mixed-precision with --zero-2-memory-optimization runs in bf16: Megatron-FSDP has no "
                              "fp16 loss scaling, and bf16 needs none")
    return cfg


def _moe_tensor_parallel(values: dict) -> str:
    """`rapidformer` has no --sequence-parallel or --expert-tensor-parallel-size: MoE with tensor parallelism
    gets what megatron-core needs (sequence parallelism; whole experts per rank for their biases). Returns the
    log line ('' when nothing was chosen)."""
    tp = values.get("tensor_model_parallel_size", 1)
    if not values.get("num_experts") or tp < 2:
        return ""
    values["sequence_parallel"] = True
    values.setdefault("expert_tensor_parallel_size", 1)
    return (f"--num-experts with --tensor-model-parallel-size {tp}: sequence parallelism on (megatron-core's MoE "
            "layers train tensor parallel only with it) and each expert whole on one rank (expert tensor-parallel "
            "size 1: megatron-core supports expert biases only there)")
