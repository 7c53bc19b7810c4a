"""Mixed precision for Hugging Face models: `--mixed-precision` (fp16 autocast with dynamic loss scaling)
and `--bf16` (bf16 autocast, no scaler); neither: fp32.

Weights, gradients and optimizer state stay fp32 in every mode; autocast runs the matrix multiplies in
the low precision and keeps the ops that need range (softmax, layer norm, the loss Hugging Face
computes inside forward) in fp32. The same holds under FSDP2 (ZeRO-2/3), see `apply_fsdp`.

The loop, for every switch:

    with precision.autocast():
        loss = model(**batch).loss
    precision.backward(loss)
    grad_norm, skipped = precision.step(optimizer, model, clip_grad)
    optimizer.zero_grad()

Loss scaling with several workers uses torch's ShardedGradScaler, which all-reduces the "found inf"
flag: with FSDP2 each rank sees only its shard of the gradients, and with ZeRO-1 a rank that skipped
the step while another stepped would deadlock ZeroRedundancyOptimizer's parameter broadcast.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Optional, Tuple

import torch
import torch.distributed as dist

# DTensor warns once per step when ShardedGradScaler's one-element "found inf" tensor meets DTensor
# gradients (FSDP2): it is replicated implicitly, which is what the scaler means.
_DTENSOR_SCALAR_WARNING = "Found a non-scalar tensor with numel=1"


class Precision:
    """Autocast, loss scaling and the optimizer step with gradient clipping, for one dtype."""

    def __init__(self, dtype: Optional[torch.dtype], device: torch.device, distributed: bool = False) -> None:
        if dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(f"Precision: dtype {dtype} is not fp16, bf16 or None (fp32)")
        self.dtype, self.device = dtype, torch.device(device)
        self.scaler = None
        if dtype == torch.float16:
            if distributed:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler(device=self.device.type)
            else:
                self.scaler = torch.amp.GradScaler(self.device.type)

    @property
    def name(self) -> str:
        return {torch.float16: "fp16", torch.bfloat16: "bf16", None: "fp32"}[self.dtype]

    def describe(self, onnx_runtime: bool = False) -> str:
        """One log line. `onnx_runtime`: the model runs as ORTModule (--onnx-runtime-training), whose exported
        graph carries the autocast casts of its first forward."""
        name = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(self.dtype)
        if name is None:
            return "precision: fp32"
        where = (f"{name} autocast recorded into ONNX Runtime's graph at its export (the first forward, inside "
                 f"autocast: casts to {name} around the matrix multiplies, which ONNX Runtime runs)" if onnx_runtime
                 else f"{name} autocast on {self.device.type}")
        text = f"mixed precision: {where}"
        if self.dtype == torch.float16:
            text += f", dynamic loss scaling ({type(self.scaler).__name__})"
        text += ", fp32 weights, gradients and optimizer state"
        if self.dtype == torch.float16 and self.device.type == "cpu":
            # CPUs have no fast fp16 matmul. Measured (tiny BERT, one thread): eager fp16 ~10-24x slower than fp32;
            # ONNX Runtime's fp16 graph 1.7x slower than its fp32 one.
            slower = "about 1.7x" if onnx_runtime else "about 10x"
            text += (f"; WARNING: fp16 on a CPU is {slower} slower than fp32: drop --mixed-precision or pass --bf16 "
                     "on a CPU")
        return text

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
             clip_grad: float) -> Tuple[torch.Tensor, bool]:
        """Unscale (fp16), clip the global gradient norm to `clip_grad` (when > 0), step (skipped under fp16
        when a gradient is inf/nan), update the loss scale. Returns (global gradient norm before clipping, a
        0-dim tensor on the device: reading it waits for the GPU, so read it only when logging; skipped).
        The caller zeroes the gradients."""
        if self.scaler is not None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_DTENSOR_SCALAR_WARNING)
                self.scaler.unscale_(optimizer)
        norm = clip_grad_norm(model, clip_grad)
        if self.scaler is None:
            optimizer.step()
            return norm, False
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # The scale only shrinks (by backoff_factor) on a step that found inf/nan and was skipped.
        return norm, self.scaler.get_scale() < before

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """The global L2 norm of the gradients of `model` (a 0-dim tensor; every rank gets the same number), clipped
    to `max_norm` when it is > 0. Gradients may be plain tensors (single process, DDP, ZeRO-1: already all-reduced) or
    FSDP2's sharded DTensors: their norm is a DTensor whose `full_tensor()` is the norm over all shards."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, foreach=True)
    total = _full(total)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def precision_for(args, device: torch.device) -> Precision:
    dtype = None
    if getattr(args, "mixed_precision", False):
        dtype = torch.float16
    elif getattr(args, "bf16", False):
        dtype = torch.bfloat16
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return Precision(dtype, device, distributed)
