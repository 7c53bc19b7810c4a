"""Forward + backward time of torch's scaled_dot_product_attention per backend (cuDNN, flash, memory-efficient), for
inputs laid out as megatron-core hands them over ([s, b, h, d] permuted to [b, h, s, d], what SDPAttention passes)
and as contiguous [b, h, s, d]. Default: the Llama 1.3B shape of bench_pretrain.py (batch 4, 16 heads, seq 2048,
head dim 128, causal, bf16). GPU only.

    python benchmarks/bench_attention.py [--batch 4 --heads 16 --seq 2048 --head-dim 128 --iters 20]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_one(backend, layout: str, b: int, h: int, s: int, d: int, iters: int) -> float:
    """Milliseconds per forward + backward."""
    shape = (b, h, s, d) if layout == "bhsd" else (s, b, h, d)
    ts = [torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    q, k, v = ts if layout == "bhsd" else [t.permute(1, 2, 0, 3) for t in ts]
    grad = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(backend):
        for _ in range(3):  # warm-up (cuDNN builds its plan on the first call)
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    b, h, s, d = a.batch, a.heads, a.seq, a.head_dim
    flops = 4 * b * h * s * s * d * 0.5 * 3.5  # causal: half the scores; backward 2.5x the forward
    print(f"{torch.cuda.get_device_name()} | b{b} h{h} s{s} d{d} causal bf16, forward + backward")
    print(f"{'backend':<20} | {'layout':<6} | {'ms':>7} | {'TFLOP/s':>7}")
    for layout in ("bhsd", "sbhd"):
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                ms = time_one(backend, layout, b, h, s, d, a.iters)
                print(f"{backend.name:<20} | {layout:<6} | {ms:7.3f} | {flops / ms / 1e9:7.0f}")
            except RuntimeError as e:  # a backend that does not support this shape or GPU
                print(f"{backend.name:<20} | {layout:<6} | unavailable: {str(e).splitlines()[0][:80]}")


if __name__ == "__main__":
    main()
