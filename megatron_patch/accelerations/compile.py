"""`--torch-compile` (`--torch-compile-mode`): graph capture and fusion with torch.compile, applied in place
so parameter names, state dicts and the DDP/FSDP2 wrappers stay as they are.

  FSDP2      each layer unit's `forward` is compiled; FSDP2's all-gather/reshard hooks run around it,
             outside the compiled graph (as torchtitan compiles per block).
  otherwise  the model itself (inside DDP, when wrapped) is compiled with `Module.compile()`; called from
             DDP's forward, dynamo's DDPOptimizer splits the graph at DDP's bucket boundaries so the
             gradient all-reduce still overlaps the backward.

Modes reduce-overhead and max-autotune also replay the compiled forward and backward as CUDA graphs (one per
batch shape; the front end pads batches to --pad-to-multiple-of): the CPU then launches a few graphs a
step instead of about a thousand kernels, which is where an eager fine-tuning step of a BERT-base model
spends most of its time (benchmarks/RESULTS.md). A graph's outputs are overwritten by its next replay, so
the training loop marks each step (`mark_step`) and keeps copies of what it holds across steps.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def uses_cuda_graphs(args) -> bool:
    """True when --torch-compile-mode replays CUDA graphs (on a GPU; on the CPU inductor skips them)."""
    return bool(getattr(args, "torch_compile", False)) and getattr(args, "torch_compile_mode", None) in CUDA_GRAPH_MODES


def apply_compile(model: torch.nn.Module, fsdp_layers: Optional[List[torch.nn.Module]] = None,
                  mode: Optional[str] = None, device: Optional[torch.device] = None) -> str:
    kwargs = {"mode": mode} if mode and mode != "default" else {}
    graphs = ""
    if mode in CUDA_GRAPH_MODES:
        graphs = (", CUDA graphs per batch shape" if device is not None and torch.device(device).type == "cuda"
                  else ", without CUDA graphs (they need a GPU)")
    how = f" (mode {mode}{graphs})" if kwargs else ""
    if fsdp_layers:
        for layer in fsdp_layers:
            layer.forward = torch.compile(layer.forward, **kwargs)
        return (f"torch.compile{how}: each of the {len(fsdp_layers)} FSDP2 layer units compiled "
                "(hooks outside the graphs)")
    inner = getattr(model, "module", model)  # DDP's wrapped module
    inner.compile(**kwargs)
    return f"torch.compile{how}: the whole model compiled in place" + (" (inside DDP)" if inner is not model else "")


def mark_step() -> None:
    """Tell the CUDA-graph runtime a new training step begins: the previous step's graph outputs may be
    overwritten from here on (torch.compiler.cudagraph_mark_step_begin)."""
    torch.compiler.cudagraph_mark_step_begin()


def eager_evaluation() -> contextlib.AbstractContextManager:
    """Run compiled modules eagerly (evaluation under CUDA-graph modes): metric code keeps outputs of earlier
    batches (logits, predictions), which a replayed graph would overwrite, and eval mode would compile and
    record another set of graphs for a pass that runs once an epoch."""
    return torch.compiler.set_stance("force_eager")
