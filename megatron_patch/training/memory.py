"""Bytes of model state this rank holds: weights, gradient buffers, optimizer state (fp32 main
weights and Adam moments). Storage is counted once even when several tensors view it."""
from __future__ import annotations

from typing import Dict, Iterable

import torch


def _storage_bytes(tensors: Iterable, seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        t = getattr(t, "_local_tensor", t)
        s = t.untyped_storage()
        key = s.data_ptr()
        if s.nbytes() and key not in seen:
            seen.add(key)
            total += s.nbytes()
    return total


def model_state_bytes(model, optimizer) -> Dict[str, int]:
    """{"weights", "grads", "optimizer"} bytes on this rank (weights before grads before optimizer)."""
    seen: set = set()
    weights, grads = [], []
    main_weights = []
    for chunk in model:
        fsdp = getattr(chunk, "param_and_grad_buffer", None)
        if fsdp is not None:  # Megatron-FSDP (ZeRO-2): sharded buffers per parameter group
            for group in fsdp.parameter_groups:
                for name, bucket in (("model_weight_buffer", weights), ("transpose_weight_buffer", weights),
                                     ("main_weight_buffer", main_weights), ("main_grad_buffer", grads)):
                    buf = getattr(group, name, None)
                    if buf is not None:
                        bucket.append(getattr(buf, "data", None))
            continue  # its module parameters are the fp32 main-weight shards, counted as optimizer state
        for buf in list(chunk.buffers) + list(getattr(chunk, "expert_parallel_buffers", [])):
            weights.append(buf.param_data)
            grads.append(buf.grad_data)
        for p in chunk.parameters():
            weights.append(p)
            grads += [getattr(p, "main_grad", None), p.grad]
    out = {"weights": _storage_bytes(weights, seen), "grads": _storage_bytes(grads, seen)}
    opt_tensors = list(main_weights)
    for w in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = w.optimizer
        for group in inner.param_groups:
            opt_tensors += list(group["params"])
        for state in inner.state.values():
            opt_tensors += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    out["optimizer"] = _storage_bytes(opt_tensors, seen)
    return out
