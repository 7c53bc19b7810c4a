"""Batches read on tensor-parallel rank 0 only and sent to the rest of the tensor-parallel group (Megatron-LM's
`broadcast_data`): the ranks of a tensor-parallel group compute on the same batch, so one of them reads it."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as _ps

from .initialize import current_device


def _tp_group():
    if not dist.is_initialized() or not _ps.model_parallel_is_initialized():
        return None
    if _ps.get_tensor_model_parallel_world_size() == 1:
        return None
    return _ps.get_tensor_model_parallel_group()


def _to_device(x, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`x` on `device` as `dtype`. A pinned batch (the DataLoader pins them on GPU machines) is copied without
    waiting: a blocking copy would drain the GPU's queue once per key and micro batch. The dtype changes after
    the copy, on the device, so the pinned buffer is what travels."""
    t = torch.as_tensor(x)
    return t.to(device, non_blocking=t.device.type == "cpu" and t.is_pinned()).to(dtype)


def broadcast_data(keys: List[str], data: Optional[Dict[str, torch.Tensor]], datatype: torch.dtype
                   ) -> Dict[str, torch.Tensor]:
    """`data[key]` for each of `keys`, as `datatype` tensors on this rank's device, the same on every rank of
    the tensor-parallel group: tensor-parallel rank 0 holds `data` (a dict of tensors or arrays), the other
    ranks pass None and receive it (shapes first, then one flat buffer)."""
    group = _tp_group()
    device = current_device()
    if group is None:
        if data is None:
            raise ValueError("broadcast_data: `data` is None on a rank that reads the data (tensor-parallel rank 0, "
                             "or a run without tensor parallelism): the data iterator ran out or was not given")
        missing = [k for k in keys if k not in data]
        if missing:
            raise KeyError(f"broadcast_data: the batch has no {missing} (it has {sorted(data)})")
        return {k: _to_device(data[k], device, datatype) for k in keys}
    src = _ps.get_tensor_model_parallel_src_rank()
    is_src = _ps.get_tensor_model_parallel_rank() == 0
    max_dims = 8
    sizes = torch.zeros(len(keys) * max_dims, dtype=torch.int64, device=device)
    if is_src:
        if data is None:
            raise ValueError("broadcast_data: `data` is None on tensor-parallel rank 0, which reads the data: the "
                             "data iterator ran out")
        for i, k in enumerate(keys):
            t = torch.as_tensor(data[k])
            if t.dim() > max_dims - 1:
                raise ValueError(f"broadcast_data: {k!r} has {t.dim()} dimensions; at most {max_dims - 1}")
            sizes[i * max_dims] = t.dim()  # then the shape: 0-dim and empty tensors travel too
            sizes[i * max_dims + 1: i * max_dims + 1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    dist.broadcast(sizes, src, group=group)
    shapes = []
    for i in range(len(keys)):
        row = sizes[i * max_dims:(i + 1) * max_dims].tolist()
        shapes.append(row[1:1 + row[0]])
    numels = [int(torch.Size(s).numel()) for s in shapes]
    if is_src:
        flat = torch.cat([_to_device(data[k], device, datatype).reshape(-1) for k in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    dist.broadcast(flat, src, group=group)
    out, offset = {}, 0
    for k, shape, n in zip(keys, shapes, numels):
        out[k] = flat[offset:offset + n].view(shape)
        offset += n
    return out
