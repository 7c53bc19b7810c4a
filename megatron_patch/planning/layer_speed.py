"""How fast one GPU runs a transformer layer, by the layer's forward FLOPs per token on one rank: the measured
table behind the planner's compute time (benchmarks/bench_layer_speed.py writes it; each row one shape,
forward + backward of one engine layer in bf16 at sequence 2048, timed on the card named)."""
from __future__ import annotations

import bisect
import math
from typing import Dict, List, Tuple

from .hardware import Gpu

# card -> [(forward FLOPs per token of the layer on one rank, achieved TFLOP/s over forward + backward)]
MEASURED: Dict[str, List[Tuple[float, float]]] = {
    # seed (DESIGN.md's whole-model figures on an H200: GPT-2 124M 41.9% MFU, Llama 1.3B 60.7% MFU), until
    # the per-layer table is measured
    "h100-80gb": [(2.8e7, 414.0), (2.0e8, 600.0)],
}


def achieved_tflops(g: Gpu, layer_flops: float) -> float:
    """TFLOP/s one GPU of kind `g` reaches on a layer of `layer_flops` forward FLOPs per token (log-linear between
    measured sizes, flat beyond them); a card without a table scales the H100's by its peak."""
    key = next((k for k, v in _cards().items() if v is g), None)
    table = MEASURED.get(key) if key else None
    scale = 1.0
    if table is None:
        table, scale = MEASURED["h100-80gb"], g.bf16_tflops / 989.0
    xs = [math.log(x) for x, _ in table]
    x = math.log(max(layer_flops, 1.0))
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return table[0][1] * scale
    if i == len(xs):
        return table[-1][1] * scale
    w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return (table[i - 1][1] * (1 - w) + table[i][1] * w) * scale


def _cards():
    from .hardware import GPUS

    return GPUS
