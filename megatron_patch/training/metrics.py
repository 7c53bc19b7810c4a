"""Throughput and model FLOPs utilisation: TFLOP/s counted as (6N + 12*L*h*s) per token."""
from __future__ import annotations

from typing import Optional

import torch

# Dense bf16/fp16 tensor-core peaks (TFLOP/s) from vendor datasheets, matched against the device name.
PEAK_TFLOPS = [
    ("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("GH200", 989.0), ("A100", 312.0), ("A800", 312.0),
    ("L40S", 362.0), ("L40", 181.0), ("A10", 125.0), ("V100", 125.0), ("4090", 165.0), ("3090", 71.0),
]


def peak_tflops() -> Optional[float]:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, peak in PEAK_TFLOPS:
        if key in name:
            return peak
    return None


def flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_length: int) -> float:
    """Training FLOPs per token: 6N for the weights (forward + backward) plus 12*L*h*s for attention."""
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_length
