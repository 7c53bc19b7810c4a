"""compat.multi_tensor: the foreach replacements of megatron-core's local multi-tensor fallbacks compute what
upstream's do (the l2 norm over all tensors; dst = src * scale with dtype conversion), on the CPU."""
from __future__ import annotations

import torch

from megatron_patch.compat.multi_tensor import foreach_l2_norm, foreach_scale


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
