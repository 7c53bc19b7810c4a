"""`--profile`: torch.profiler over iterations (--profile-step-start, --profile-step-end], with a breakdown of
the GPU's time by kind of kernel (matrix multiply, attention, loss, optimizer, communication, the rest: norms,
activations, RoPE and other elementwise work) and its idle time, printed by rank 0 and written as JSON next to
the Chrome trace (open it in Perfetto or chrome://tracing)."""
from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

# First match wins; kernel names of cuBLAS/cuBLASLt/CUTLASS, PyTorch's flash/mem-efficient SDPA, its loss and
# fused-optimizer kernels and NCCL. Triton kernels from torch.compile (fused norms, activations) fall to "other".
CATEGORIES: List[Tuple[str, re.Pattern]] = [
    ("communication", re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|splitk|matmul", re.I)),
    ("loss", re.compile(r"cross_entropy|log_softmax|nll_loss|softmax", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|l2norm", re.I)),  # not "lamb": kernel names say "lambda"
    ("memcpy/memset", re.compile(r"memcpy|memset", re.I)),
]


def categorize(name: str) -> str:
    for category, pattern in CATEGORIES:
        if pattern.search(name):
            return category
    return "other (norms, elementwise)"


def breakdown(kernels: List[Tuple[str, float, float]]) -> Dict[str, float]:
    """Seconds of GPU time per category, plus "idle": the profiled span (first kernel start to last kernel end)
    minus the union of the kernels' intervals. `kernels` are (name, start_s, end_s)."""
    out: Dict[str, float] = {}
    for name, start, end in kernels:
        category = categorize(name)
        out[category] = out.get(category, 0.0) + (end - start)
    if kernels:  # idle: the gaps between the end of all kernels so far and the next one's start
        idle, reach = 0.0, None
        for _, start, end in sorted(kernels, key=lambda k: k[1]):
            if reach is not None and start > reach:
                idle += start - reach
            reach = end if reach is None else max(reach, end)
        out["idle"] = idle
    return out


def top_kernels(kernels: List[Tuple[str, float, float]], n: int = 5) -> Dict[str, List[Tuple[str, float]]]:
    """The `n` kernels (by total seconds) of each category, names cut to 100 characters."""
    totals: Dict[str, float] = {}
    for name, start, end in kernels:
        totals[name] = totals.get(name, 0.0) + (end - start)
    out: Dict[str, List[Tuple[str, float]]] = {}
    for name, secs in sorted(totals.items(), key=lambda kv: -kv[1]):
        rows = out.setdefault(categorize(name), [])
        if len(rows) < n:
            rows.append((name[:100], secs))
    return out


def format_breakdown(seconds: Dict[str, float], steps: int) -> str:
    total = sum(seconds.values())
    rows = [f"GPU time per step over {steps} profiled steps ({1e3 * total / max(steps, 1):.1f} ms a step):"]
    for k, v in sorted(seconds.items(), key=lambda kv: -kv[1]):
        rows.append(f"  {k:<28} {1e3 * v / max(steps, 1):9.2f} ms  {100 * v / total:5.1f}%")
    return "\n".join(rows)


class Profiler:
    """Starts torch.profiler before iteration `start` + 1 and stops after iteration `end`; `step(iteration)` is
    called after each iteration. Off (every call a no-op) without --profile."""

    def __init__(self, cfg, rank: int) -> None:
        self.enabled = bool(cfg.profile)
        self.start, self.end = cfg.profile_step_start, cfg.profile_step_end
        self.dir = cfg.profile_dir
        self.rank = rank
        self.prof: Optional[torch.profiler.profile] = None

    def step(self, iteration: int) -> Optional[Dict[str, float]]:
        """Called after iteration `iteration` finished. Returns the breakdown when profiling just ended."""
        if not self.enabled:
            return None
        if iteration == self.start and self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
        elif iteration == self.end and self.prof is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            return self._report(self.end - self.start)
        return None

    def _report(self, steps: int) -> Dict[str, float]:
        kernels = [(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6) for e in self.prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        seconds = breakdown(kernels)
        os.makedirs(self.dir, exist_ok=True)
        self.prof.export_chrome_trace(os.path.join(self.dir, f"trace_rank{self.rank}.json"))
        if self.rank == 0:
            every = top_kernels(kernels, n=len(kernels))  # every kernel by category, largest first
            with open(os.path.join(self.dir, "breakdown.json"), "w") as f:
                json.dump({"steps": steps, "seconds": seconds, "kernels": every,
                           "top_kernels": {c: rows[:5] for c, rows in every.items()}}, f, indent=1)
            print(format_breakdown(seconds, steps) if seconds else "profile: no GPU kernels recorded (CPU run)",
                  flush=True)
        self.prof = None
        return seconds
