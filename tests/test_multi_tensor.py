"""compat.multi_tensor: the foreach replacements of megatron-core's local multi-tensor fallbacks compute what
upstream's do (the l2 norm over all tensors; dst = src * scale with dtype conversion), on the CPU."""
from __future__ import annotations

import pytest
import torch

from megatron_patch.compat.multi_tensor import foreach_l2_norm, foreach_scale, foreach_scale_tensor


def _tensors(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float32).to(dtype) for shape in ((7, 5), (13,), (3, 4, 2), (1,))]


def test_l2_norm_is_the_norm_over_all_tensors_of_all_lists():
    a, b = _tensors(0), _tensors(1)
    norm, per_tensor = foreach_l2_norm(2048, None, [a, b], False)
    want = torch.linalg.vector_norm(torch.cat([t.flatten() for t in a + b]).double())
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert torch.allclose(norm.double(), want.reshape(1), rtol=1e-6, atol=0)


def test_scale_writes_src_times_scale_into_dst_in_dst_dtype():
    src = _tensors(2)
    for scale in (1.0, 0.25):
        dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
        foreach_scale(2048, None, [src, dst], scale)
        for s, d in zip(src, dst):
            assert d.dtype == torch.bfloat16 and torch.equal(d, (s * scale).to(torch.bfloat16))
    in_place = [t.clone() for t in src]
    foreach_scale(2048, None, [in_place, in_place], 0.5)  # clipping scales the gradients in place
    assert all(torch.equal(x, s * 0.5) for x, s in zip(in_place, src))


def test_scale_tensor_clips_in_place_by_a_device_coefficient():
    """What megatron-core's clip_grad_by_total_norm_fp32 does with a tensor norm: grads *= min(1, max/norm)."""
    grads = _tensors(3)
    want = [t.clone() for t in grads]
    coeff = (torch.tensor([1.0]) / (torch.tensor([4.0]) + 1e-6)).clamp_max_(1.0)  # shape [1], as upstream's
    foreach_scale_tensor(2048, None, [grads, grads], coeff)
    assert all(torch.equal(g, w * coeff.reshape(())) for g, w in zip(grads, want))
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in want]
    foreach_scale_tensor(2048, None, [want, dst], torch.tensor([0.5]))
    assert all(torch.equal(d, (w * 0.5).to(torch.bfloat16)) for d, w in zip(dst, want))


@pytest.mark.gpu  # megatron-core's clip_grads allocates on "cuda"
def test_megatron_clips_without_reading_the_norm_once_patched(tmp_path):
    """With the patch, megatron-core's own get_grad_norm_fp32 / clip_grad_by_total_norm_fp32 keep the norm a
    tensor and clip by it (their TE path); the result equals clipping by the float norm."""
    from megatron.core.optimizer import clip_grads

    from megatron_patch.compat import multi_tensor
    from megatron_patch.compat.registry import _ORIGINALS

    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)  # the norm's all-reduce
    multi_tensor.grad_clip_without_host_sync()
    try:
        params = [torch.nn.Parameter(t.cuda()) for t in _tensors(4)]
        for p in params:
            p.grad = torch.randn_like(p) * 10
        want = [p.grad.clone() for p in params]
        norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
        assert isinstance(norm, torch.Tensor)
        clip_grads.clip_grad_by_total_norm_fp32(params, 1.0, norm)
        ref = torch.linalg.vector_norm(torch.cat([w.flatten() for w in want]))
        for p, w in zip(params, want):
            torch.testing.assert_close(p.grad, w * (1.0 / (ref + 1e-6)))
    finally:
        clip_grads.multi_tensor_scale_tensor_impl = _ORIGINALS.pop((clip_grads, "multi_tensor_scale_tensor_impl"))
        dist.destroy_process_group()
