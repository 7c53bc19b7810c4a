"""The PreTrainer with a Megatron model: the user's hooks drive the engine's Trainer (megatron_patch.training).

The engine's order is kept (process groups and seeds, then datasets, then the model, then the wrappers,
optimizer and schedule), so the same flags give the same samples, weights and losses as
`pretrain_megatron_gpt.py`. The user's `run_forward_step(data_iterator, model)` returns a loss; megatron-core's
schedules want `(output, loss_func)` from every pipeline stage, and hidden states from every stage but the
last. `_StageModel` stands for the model in the user's code: it records what the real model chunk returned,
and on a stage that is not the last gives the user's loss code per-token zeros of the right shape, so the
code runs as written while the schedule sends the recorded hidden states on.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import List, Optional

import torch

from megatron_patch.config import Config, ConfigError

from .globals import get_logger

_CONFIG: Optional[Config] = None

# rapidformer flags whose engine name differs; every other Config field is taken by its own name
_RENAMED = {"torch_compile": "compile", "torch_compile_mode": "compile_mode"}
# Hugging Face-only sharding switches: the Megatron engine shards with ZeRO-1/2 (its distributed optimizer,
# Megatron-FSDP)
_HF_ONLY = ("oss_memory_optimization", "oss_sdp_memory_optimization", "fsdp_memory_optimization")


def engine_config(args: argparse.Namespace, accelerations: bool = True) -> Config:
    """The engine's Config for the `rapidformer` flags (not yet validated). `accelerations=False` leaves out the
    switches (ZeRO, precision, recompute, offload, compile): enough to start process groups before the model
    says whether it is a Megatron model."""
    names = {f.name for f in dataclasses.fields(Config)}
    switches = {"zero_1_memory_optimization", "zero_2_memory_optimization", "zero_3_memory_optimization", "bf16",
                "fp16", "mixed_precision", "checkpoint_activations", "cpu_offload", "compile",
                "compile_mode"}
    values = {}
    for key, value in vars(args).items():
        key = _RENAMED.get(key, key)
        if key in names and value is not None and (accelerations or key not in switches):
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
        if getattr(args, "onnx_runtime_training", False):
            raise ConfigError("--onnx-runtime-training: ONNX Runtime's ORTModule trains Hugging Face/PyTorch models "
                              "(one exported graph per model); a megatron-core model trains with the engine's own "
                              "tensor/pipeline-parallel schedules, which ORTModule cannot export: drop the flag, or "
                              "use --torch-compile, the engine's graph optimizer")
        if moe_tp:
            get_logger().info(moe_tp)
        used = [f"--{n.replace('_', '-')}" for n in _HF_ONLY if getattr(args, n, False)]
        if used:
            raise ConfigError(f"{', '.join(used)}: a Hugging Face acceleration; a Megatron model is sharded with "
                              "--zero-1-memory-optimization (distributed optimizer) or --zero-2-memory-optimization "
                              "(Megatron-FSDP): use one of those")
        if getattr(args, "data_iterator", None) == "dynamic-shape":
            raise ConfigError("--data-iterator dynamic-shape: a Megatron model's pipeline sends activations of a fixed "
                              "--seq-length between stages, and GPT samples are packed to it with no padding to cut; "
                              "drop the flag (it applies to Hugging Face models on padded BERT-style samples)")
        if cfg.mixed_precision and cfg.zero_2_memory_optimization:
            # megatron-core's fp16 loss scaling does not run under Megatron-FSDP: bf16 needs none
            cfg.mixed_precision, cfg.bf16 = False, True
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


_WORLD = 1


def set_current_config(cfg: Optional[Config], world_size: int = 1) -> None:
    """Start (cfg = the flags without accelerations, process groups up) or end (None) a PreTrainer run."""
    global _CONFIG, _BASE, _WORLD
    _CONFIG, _BASE, _WORLD = None, cfg, world_size


_BASE: Optional[Config] = None


def current_config() -> Config:
    """The engine Config of the PreTrainer run under way, with every switch (ZeRO, precision, recompute): what
    GPTModel() builds from. Built and validated on first use, so a Hugging Face run never needs it."""
    global _CONFIG
    if _BASE is None:
        raise RuntimeError("GPTModel() builds this rank's stage of the PreTrainer run's model: call it inside "
                           "model_optimizer_lr_scheduler_provider(), once PreTrainer.train() has started")
    if _CONFIG is None:
        from .globals import get_args

        _CONFIG = engine_config(get_args()).validate(_WORLD)
    return _CONFIG


def is_megatron_model(model) -> bool:
    """A megatron-core module (or a list of them, one per virtual pipeline stage)."""
    from megatron.core.transformer.module import MegatronModule

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return bool(chunks) and all(isinstance(c, MegatronModule) for c in chunks)


class _StageModel:
    """The `model` the user's run_forward_step calls: the real chunk, whose output is recorded."""

    def __init__(self, chunk: torch.nn.Module, last: bool) -> None:
        self._chunk, self._last, self.output = chunk, last, None

    def __call__(self, *args, **kwargs):
        out = self._chunk(*args, **kwargs)
        self.output = out
        if self._last:
            return out
        # Not the last stage: `out` is hidden states [s, b, h] for the next stage. The user's code computes a
        # loss from per-token losses [b, s]; zeros let it run, and its result is not used.
        tokens = args[0] if args else kwargs.get("input_ids")
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else (out.shape[1], out.shape[0])
        return torch.zeros(shape, dtype=torch.float32, device=out.device)

    def __getattr__(self, name: str):
        return getattr(self._chunk, name)


def _loss_func(loss: torch.Tensor):
    def loss_func(output_tensor):
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place
    return loss_func


def megatron_forward_step(run_forward_step):
    """megatron-core's forward-step function around the user's `run_forward_step(data_iterator, model)`."""
    from megatron_patch.training.loop import no_loss, stage_flags

    def forward_step(data_iterator, model):
        last = stage_flags(model)[1]
        stage = _StageModel(model, last)
        loss = run_forward_step(data_iterator, stage)
        if stage.output is None:
            raise RuntimeError("run_forward_step(data_iterator, model) returned without calling model(...): the "
                               "pipeline needs the model's output")
        if last:
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError("run_forward_step(data_iterator, model) must return the loss as a 0-dim tensor, got "
                                f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
            return loss, _loss_func(loss)
        return stage.output, no_loss
    return forward_step


def run(pretrainer, cfg: Config, datasets, model) -> List[dict]:
    """Train a Megatron model with the engine: `datasets` and `model` come from the user's hooks."""
    from megatron.core import parallel_state as mpu

    from megatron_patch.training.data import build_iterator
    from megatron_patch.training.loop import Trainer

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    forward = megatron_forward_step(pretrainer.run_forward_step)

    class TemplateTrainer(Trainer):
        def _initialize(self, c: Config) -> Config:
            return c  # process groups and seeds were set before the hooks ran, as the engine orders them

        def _build_datasets(self):
            return datasets

        def _build_chunks(self, vocab: int) -> List[torch.nn.Module]:
            return chunks

        def _forward_step_func(self):
            return forward

        def _reads_data(self, chunk) -> bool:
            # the user's run_forward_step reads on every stage; its broadcast_data serves the other TP ranks
            return mpu.get_tensor_model_parallel_rank() == 0

        def _iterator(self, dataset, consumed: int, cycle: bool):
            return build_iterator(dataset, self.cfg, consumed, cycle) if dataset is not None else None

    trainer = TemplateTrainer(cfg)
    pretrainer.trainer = trainer
    return trainer.train()
