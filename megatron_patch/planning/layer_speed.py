"""How fast one GPU runs a transformer layer: the measured table behind the planner's compute time
(benchmarks/bench_planner.py measures it: each row one layer shape, the engine's forward + backward of that layer in
bf16 at sequence 2048, on the card named).

A layer's time per micro batch is modelled as `fixed + 3 x FLOPs / rate`: the rate is what the GPU reaches on the
layer's GEMMs and attention, and `fixed` is what does not grow with the tokens (the host launching the layer's
kernels in eager mode, small kernels). Both are fitted per row from two micro-batch sizes. Without `fixed`, the
small layers' rate, measured at one micro-batch size, held their launch cost: on an H200 the 350M shape (h1024) at
twice the tokens per micro batch was predicted 1.30x its measured step time.
"""
from __future__ import annotations

import bisect
import math
from typing import Dict, List, Tuple

from .hardware import GPUS, Gpu

# card -> [(forward FLOPs per token of the layer on one rank, achieved TFLOP/s over forward + backward,
#           fixed seconds per layer and micro batch for forward + backward)]; a row of two has no fixed part
MEASURED: Dict[str, List[Tuple[float, ...]]] = {
    # one NVIDIA H100 80GB HBM3, 2026-12-07 (bench_planner.py; engine eager, bf16, SDPA; layers h1024/ffn2816,
    # h2048/5504, h3072/8192, h4096/14336 GQA 8, h8192/28672 GQA 8; micro batch 4, 4, 4, 2, 1 x 2048 tokens)
    "h100-80gb": [(2.988e7, 235.0), (1.096e8, 372.8), (2.139e8, 443.2), (4.53e8, 441.4), (1.745e9, 381.9)],
    # one NVIDIA H200, 2026-12-07, the same shapes and procedure
    "h200": [(2.988e7, 201.9), (1.096e8, 413.4), (2.139e8, 486.4), (4.53e8, 461.4), (1.745e9, 411.8)],
}


def _table(g: Gpu) -> Tuple[List[Tuple[float, ...]], float]:
    key = next((k for k, v in GPUS.items() if v.name == g.name), None)
    table = MEASURED.get(key) if key else None
    if table is None:  # a card without a table: the H100's, its rate scaled by the card's peak
        return MEASURED["h100-80gb"], g.bf16_tflops / 989.0
    return table, 1.0


def _interpolate(table: List[Tuple[float, ...]], layer_flops: float, col: int) -> float:
    """Column `col` of the table, log-linear in FLOPs between measured sizes, flat beyond them."""
    xs = [math.log(r[0]) for r in table]
    ys = [r[col] if len(r) > col else 0.0 for r in table]
    x = math.log(max(layer_flops, 1.0))
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return ys[0]
    if i == len(xs):
        return ys[-1]
    w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] * (1 - w) + ys[i] * w


def achieved_tflops(g: Gpu, layer_flops: float) -> float:
    """TFLOP/s one GPU of kind `g` reaches on the work of a layer of `layer_flops` forward FLOPs per token."""
    table, scale = _table(g)
    return _interpolate(table, layer_flops, 1) * scale


def fixed_seconds(g: Gpu, layer_flops: float) -> float:
    """Seconds of a layer's forward + backward per micro batch that do not grow with its tokens."""
    table, _ = _table(g)
    return _interpolate(table, layer_flops, 2)


def fit_row(flops: float, tokens: Tuple[int, int], seconds: Tuple[float, float]) -> Tuple[float, float, float]:
    """A table row from one layer's forward + backward seconds per micro batch at two token counts: the rate from
    the difference, the fixed part from the intercept. Noise that makes the larger batch no slower, or the
    intercept negative, leaves a row with no fixed part (the rate through the origin)."""
    (n1, n2), (t1, t2) = tokens, seconds
    if t2 > t1 and n2 > n1:
        rate = 3 * flops * (n2 - n1) / (t2 - t1)
        fixed = t1 - 3 * flops * n1 / rate
        if fixed >= 0:
            return (flops, rate / 1e12, fixed)
    return (flops, max(3 * flops * (n1 + n2) / max(t1 + t2, 1e-12) / 1e12, 1e-6), 0.0)
