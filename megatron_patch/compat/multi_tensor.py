"""megatron-core's multi-tensor fallbacks (no apex, no Transformer Engine) on the GPU, without host syncs.

megatron-core 0.19.2 uses apex's/TE's `multi_tensor_l2norm` and `multi_tensor_scale` kernels when one of them is
installed, else `local_multi_tensor_l2_norm` and `local_multi_tensor_scale` (megatron/core/utils.py). Those
fallbacks cost every optimizer step a great deal on a GPU:
  - the l2 norm takes `torch.norm` of each gradient and then `torch.tensor(list_of_cuda_scalars)`, which copies
    each norm to the host one at a time: one device synchronisation per parameter tensor (about 150 for GPT-2);
  - the scale runs `dst.copy_(src * scale)` per tensor: two kernels and a temporary per parameter, for the
    fp32 main weights -> bf16 model weights copy and for clipping.
The replacements use torch's foreach kernels (a few launches for all tensors) and keep the results on the
device. The CPU backend has its own float64 norm (cpu_backend.precise_grad_norm_on_cpu), applied instead there.
"""
from __future__ import annotations

from typing import List

import torch

from .registry import original, register, replace


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists: List[List[torch.Tensor]], per_tensor, *args):
    """Drop-in for megatron-core's local_multi_tensor_l2_norm: the l2 norm over all tensors of all lists, a float32
    tensor of one element on the tensors' device, computed with torch._foreach_norm (no host synchronisation)."""
    tensors = [t for ts in tensor_lists for t in ts]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device="cuda"), None
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists: List[List[torch.Tensor]], scale: float) -> None:
    """Drop-in for megatron-core's local_multi_tensor_scale: dst = src * scale for each pair (dtype converted)."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if scale != 1.0:
        src = torch._foreach_mul(src, scale)
    torch._foreach_copy_(dst, src)


@register(upstream=("megatron/core/utils.py:local_multi_tensor_l2_norm",
                    "megatron/core/utils.py:local_multi_tensor_scale"),
          fixes="without apex/Transformer Engine, megatron-core's gradient norm syncs the host once per parameter "
                "tensor and its main->model weight copy launches two kernels per tensor: foreach kernels instead, "
                "results kept on the GPU",
          fingerprint="c9328f82628a03f4")
def foreach_multi_tensor_fallbacks() -> None:
    """Replace megatron-core's local multi-tensor fallbacks in clip_grads and optimizer (GPU, no apex/TE only)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    if original(clip_grads, "l2_norm_impl") is local_multi_tensor_l2_norm:
        replace(clip_grads, "l2_norm_impl", foreach_l2_norm)
    if original(clip_grads, "multi_tensor_scale_impl") is local_multi_tensor_scale:
        replace(clip_grads, "multi_tensor_scale_impl", foreach_scale)
    if original(mcore_optimizer, "multi_tensor_scale_impl") is local_multi_tensor_scale:
        replace(mcore_optimizer, "multi_tensor_scale_impl", foreach_scale)


def foreach_scale_tensor(chunk_size, noop_flag, tensor_lists: List[List[torch.Tensor]], scale: torch.Tensor) -> None:
    """Drop-in for Transformer Engine's multi_tensor_scale_tensor: dst = src * scale, `scale` a one-element tensor
    on the device (gradient clipping's coefficient), so nothing waits for its value."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    scale = scale.reshape(())
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


@register(upstream=("megatron/core/optimizer/clip_grads.py:get_grad_norm_fp32",
                    "megatron/core/optimizer/clip_grads.py:clip_grad_by_total_norm_fp32"),
          fixes="without Transformer Engine's multi_tensor_scale_tensor, get_grad_norm_fp32 returns "
                "total_norm.item(): a host synchronisation in the middle of every optimizer step (the GPU then idles "
                "while the host launches the update). Given a tensor-scale kernel (foreach), megatron-core keeps the "
                "norm on the device and clips with a device-side coefficient, its own path for TE",
          fingerprint="17f5e40c69302357")
def grad_clip_without_host_sync() -> None:
    """Give megatron-core's clip_grads a multi_tensor_scale_tensor (GPU, no Transformer Engine only): the grad
    norm the optimizer returns is then a one-element tensor, read by the training loop when it reports."""
    from megatron.core.optimizer import clip_grads

    if original(clip_grads, "multi_tensor_scale_tensor_impl") is None:
        replace(clip_grads, "multi_tensor_scale_tensor_impl", foreach_scale_tensor)
