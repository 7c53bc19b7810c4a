"""How fast one GPU runs a transformer layer, by the layer's forward FLOPs per token on one rank: the measured
table behind the planner's compute time (benchmarks/bench_planner.py measures it: each row one layer shape, the
engine's forward + backward of that layer in bf16 at sequence 2048, on the card named)."""
from __future__ import annotations

import bisect
import math
from typing import Dict, List, Tuple

from .hardware import GPUS, Gpu

# card -> [(forward FLOPs per token of the layer on one rank, achieved TFLOP/s over forward + backward)]
MEASURED: Dict[str, List[Tuple[float, float]]] = {
    # one NVIDIA H100 80GB HBM3, 2026-12-07 (bench_planner.py; engine eager, bf16, SDPA; layers h1024/ffn2816,
    # h2048/5504, h3072/8192, h4096/14336 GQA 8, h8192/28672 GQA 8; micro batch 4, 4, 4, 2, 1 x 2048 tokens)
    "h100-80gb": [(2.988e7, 235.0), (1.096e8, 372.8), (2.139e8, 443.2), (4.53e8, 441.4), (1.745e9, 381.9)],
    # one NVIDIA H200, 2026-12-07, the same shapes and procedure
    "h200": [(2.988e7, 201.9), (1.096e8, 413.4), (2.139e8, 486.4), (4.53e8, 461.4), (1.745e9, 411.8)],
}


def achieved_tflops(g: Gpu, layer_flops: float) -> float:
    """TFLOP/s one GPU of kind `g` reaches on a layer of `layer_flops` forward FLOPs per token (log-linear between
    measured sizes, flat beyond them); a card without a table scales the H100's by its peak."""
    key = next((k for k, v in GPUS.items() if v.name == g.name), None)
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
