"""`--compile` for the engine's megatron-core models: torch.compile per transformer layer.

Compiling the whole GPTModel traces megatron-core's `MegatronModule.__call__` (megatron/core/transformer/module.py,
0.19.2), whose CUDA-graph checks put a guard on `len(kwargs)`; the calls from the pipeline schedule and from the
transformer block differ in it, so dynamo recompiled without end on GPT-2 124M (no step within 220 s on an H200).
Compiling each layer's `forward` instead (torchtitan compiles per block the same way) keeps megatron-core's
`__call__`, the embedding, the schedule and the loss outside the graphs: every dense layer has the same code and
shapes, so dynamo compiles once and reuses that graph for the others (guards on which layer it is are cheap).
The module objects stay the same, so parameter names, state dicts and the DDP/FSDP wrappers are untouched.

MoE layers: with megatron-core's token dispatchers only their attention is compiled (the dispatchers produce
data-dependent shapes and host synchronisations that would break and recompile the graph every step); with the
device dispatcher (models/moe_dispatch.py: --moe-grouped-gemm at EP 1) the whole layer is, router and experts too.
"""
from __future__ import annotations

from functools import partial
from typing import List

import torch

from megatron_patch.compat.dynamo import tp_group_default_without_warning


def _layers(chunk: torch.nn.Module) -> List[torch.nn.Module]:
    stack = getattr(chunk, "decoder", None) or getattr(chunk, "encoder", None)
    return list(stack.layers) if stack is not None else []


def apply_compile(chunks: List[torch.nn.Module], mode: str = "default") -> str:
    """Compile every transformer layer's forward in the bare model chunks, in place, with torch.compile's `mode`;
    returns a log line."""
    compile_ = partial(torch.compile, mode=None if mode == "default" else mode)
    dense = moe = 0
    for chunk in chunks:
        for layer in _layers(chunk):
            if (type(layer.mlp).__name__ == "MoELayer"
                    and type(layer.mlp.token_dispatcher).__name__ != "DeviceTokenDispatcher"):
                layer.self_attention.forward = compile_(layer.self_attention.forward)
                moe += 1
            else:
                layer.forward = compile_(layer.forward)
                dense += 1
    tp_group_default_without_warning()  # else two graph breaks per layer (see compat/dynamo.py)
    # Each compiled method has its own cache keyed by the bound layer; one entry per layer is expected.
    limit = max(dense, moe) + 8
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit,
                                                           4 * limit)
    parts = ([f"{dense} transformer layers"] if dense else []) + ([f"the attention of {moe} MoE layers"] if moe else [])
    how = "" if mode == "default" else f", mode {mode}"
    if mode == "reduce-overhead" and not torch.cuda.is_available():
        how += " (no GPU: runs without CUDA graphs)"
    return "torch.compile: " + " and ".join(parts) + f" compiled{how} (embedding, loss and schedule eager)"
