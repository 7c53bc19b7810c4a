"""The GPUs the planner knows: memory, dense bf16 peak, HBM bandwidth, and the default interconnect."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int  # what torch.cuda.get_device_properties().total_memory reports
    bf16_tflops: float  # dense peak
    hbm_gbps: float
    intra_node_gbps: float  # NVLink, per GPU, one direction, as NCCL's bus bandwidth reaches it
    inter_node_gbps: float  # one 400 Gb/s NIC per GPU
    gpus_per_node: int = 8


GPUS: Dict[str, Gpu] = {
    "h100-80gb": Gpu("NVIDIA H100 80GB HBM3 (SXM)", 85_032_878_080, 989.0, 3350.0, 360.0, 45.0),
    "h200": Gpu("NVIDIA H200 (SXM, 141 GB)", 150_754_820_096, 989.0, 4800.0, 360.0, 45.0),
    "a100-80gb": Gpu("NVIDIA A100 80GB (SXM)", 85_198_045_184, 312.0, 2039.0, 230.0, 22.0),
    "a100-40gb": Gpu("NVIDIA A100 40GB (SXM)", 42_505_273_344, 312.0, 1555.0, 230.0, 22.0),
}


def gpu(name: str) -> Gpu:
    if name not in GPUS:
        raise ValueError(f"--gpu {name!r}: choose one of {', '.join(GPUS)}")
    return GPUS[name]
