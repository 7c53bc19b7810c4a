"""Which switches are on, and which combinations are impossible (checked before any worker starts).

The partitioning flags come in two families that promise the same three stages (parameter guide,
"partisi status model menggunakan ZeRO, OSS, SDP, atau FSDP"):

    stage 1  optimizer state                         --zero-1-memory-optimization   --oss-memory-optimization
    stage 2  optimizer state + gradients             --zero-2-memory-optimization   --oss-sdp-memory-optimization
    stage 3  optimizer state + gradients + weights   --zero-3-memory-optimization   --fsdp-memory-optimization

Both families run on the same torch.distributed machinery here (ZeroRedundancyOptimizer for stage 1,
FSDP2 for stages 2 and 3); they differ only in what the guide allows next to --cpu-offload.
"""
from __future__ import annotations

import argparse
from typing import List, Optional, Tuple

# attribute -> (stage, family)
PARTITIONING = {
    "zero_1_memory_optimization": (1, "zero"),
    "oss_memory_optimization": (1, "fairscale"),
    "zero_2_memory_optimization": (2, "zero"),
    "oss_sdp_memory_optimization": (2, "fairscale"),
    "zero_3_memory_optimization": (3, "zero"),
    "fsdp_memory_optimization": (3, "fairscale"),
}
ZERO_FLAG = {1: "--zero-1-memory-optimization", 2: "--zero-2-memory-optimization", 3: "--zero-3-memory-optimization"}
GUIDE_OFFLOAD = ("Untuk mengaktifkan pelatihan beban CPU dan partisi status model secara bersamaan, ZeRO harus "
                 "digunakan")


def flag(attribute: str) -> str:
    """'zero_1_memory_optimization' -> '--zero-1-memory-optimization'."""
    return "--" + attribute.replace("_", "-")


def partitioning(args: argparse.Namespace) -> Tuple[int, Optional[str]]:
    """(stage 0-3, the attribute that asked for it). Call after check_combination (at most one is on)."""
    for attribute, (stage, _) in PARTITIONING.items():
        if getattr(args, attribute, False):
            return stage, attribute
    return 0, None


def check_combination(args: argparse.Namespace) -> None:
    """Raise ValueError with a sentence naming the flags and the fix, for impossible combinations."""
    from .onnx_runtime import PIP_ORT, ort_available  # imports torch: only when checking

    problems: List[str] = []
    on = [a for a in PARTITIONING if getattr(args, a, False)]
    if len(on) > 1:
        stages = {PARTITIONING[a][0] for a in on}
        same = (f" ({' and '.join(flag(a) for a in on)} name the same stage {stages.pop()}, so one of them is enough)"
                if len(stages) == 1 else "")
        problems.append(f"{' and '.join(flag(a) for a in on)} are partitioning switches and only one can be on{same}; "
                        f"keep one of them")
    if getattr(args, "mixed_precision", False) and getattr(args, "bf16", False):
        problems.append("--mixed-precision (fp16 with dynamic loss scaling) and --bf16 are two mixed-precision modes; "
                        "pass only one of them")
    optimizers = getattr(args, "optimizers", "apex_adam")
    if optimizers not in ("apex_adam", "apex_lamb"):
        problems.append(f"--optimizers {optimizers!r} is not one of apex_adam, apex_lamb; choose one of those")
    if getattr(args, "cpu_offload", False):
        for a in on:
            stage, family = PARTITIONING[a]
            if family == "fairscale":
                problems.append(f"--cpu-offload with {flag(a)}: the parameter guide requires ZeRO for CPU offload "
                                f"together with partitioned model state (\"{GUIDE_OFFLOAD}\"); use "
                                f"{ZERO_FLAG[stage]} instead of {flag(a)} (same stage)")
    from .compile import CUDA_GRAPH_MODES

    mode = getattr(args, "torch_compile_mode", None)
    if mode in CUDA_GRAPH_MODES:
        for a in on:
            if PARTITIONING[a][0] >= 2:
                problems.append(f"--torch-compile-mode {mode} (CUDA graphs) cannot run with {flag(a)}: "
                                f"a replayed graph needs its inputs at fixed addresses, while FSDP2 allocates and "
                                f"frees each layer's gathered parameters around every forward and backward, outside the graphs; use "
                                f"--torch-compile-mode default (or max-autotune-no-cudagraphs) with {flag(a)}, or "
                                f"--zero-1-memory-optimization with CUDA graphs")
    if getattr(args, "onnx_runtime_training", False):
        if getattr(args, "torch_compile", False) or mode:
            problems.append("--onnx-runtime-training and --torch-compile are two graph optimizers for the same model "
                            "(ONNX Runtime runs an exported graph that torch.compile cannot see into); pass only one "
                            "of them")
        for a in on:
            if PARTITIONING[a][0] >= 2:
                problems.append(
                    f"--onnx-runtime-training cannot run with {flag(a)}: ORTModule exports the module with its whole "
                    f"parameters as graph inputs and holds them for its ONNX Runtime session, while FSDP2 swaps each "
                    f"layer's parameters between sharded and gathered tensors around every forward and backward, so "
                    f"ONNX Runtime would train stale or sharded weights; use --zero-1-memory-optimization (optimizer "
                    f"state sharding works with ORTModule under DDP), or --torch-compile instead of "
                    f"--onnx-runtime-training")
        if getattr(args, "padding_free", False):
            problems.append("--onnx-runtime-training cannot run with --padding-free: ORTModule exports the model's "
                            "padded forward once, while packed rows go through a replaced forward and attention "
                            "function with a shape per token budget; pass only one of them")
        if not ort_available():
            problems.append(f"--onnx-runtime-training needs ONNX Runtime's training package, which is not installed: "
                            f"`{PIP_ORT}` (CPU only; the last release, and the only one for Python 3.12), or use "
                            f"--torch-compile for graph optimization instead")
    if problems:
        raise ValueError("; ".join(problems))
