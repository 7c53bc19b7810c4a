"""`--torch-compile`: graph capture and fusion with torch.compile, applied in place so parameter names,
state dicts and the DDP/FSDP2 wrappers stay as they are.

  FSDP2      each layer unit's `forward` is compiled; FSDP2's all-gather/reshard hooks run around it,
             outside the compiled graph (as torchtitan compiles per block).
  otherwise  the model itself (inside DDP, when wrapped) is compiled with `Module.compile()`; called from
             DDP's forward, dynamo's DDPOptimizer splits the graph at DDP's bucket boundaries so the
             gradient all-reduce still overlaps the backward.
"""
from __future__ import annotations

from typing import List, Optional

import torch


def apply_compile(model: torch.nn.Module, fsdp_layers: Optional[List[torch.nn.Module]] = None) -> str:
    if fsdp_layers:
        for layer in fsdp_layers:
            layer.forward = torch.compile(layer.forward)
        return f"torch.compile: each of the {len(fsdp_layers)} FSDP2 layer units compiled (hooks outside the graphs)"
    inner = getattr(model, "module", model)  # DDP's wrapped module
    inner.compile()
    return "torch.compile: the whole model compiled in place" + (" (inside DDP)" if inner is not model else "")
