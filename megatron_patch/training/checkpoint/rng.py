"""Every random stream a training step draws from, captured and restored for exact resume.

Streams: Python's `random`, NumPy's global generator, torch's CPU generator, the current CUDA device's
generator, and megatron-core's tensor-parallel RNG tracker (its named CUDA states: the model-parallel
stream that makes dropout differ between TP ranks, and the data-parallel one). Data loaders use their
own generators (megatron_patch.training.data), so they do not shift these streams.

The state is stored as plain tensors, ints and floats, so that it loads with `weights_only=True`.
Keyed as Megatron-LM does: one entry per (pipeline rank, tensor rank), with the data-parallel rank as
the replica: data-parallel ranks share seeds and draw identically, so the state follows a change of
DP size. A change of TP or PP size gives other streams, and the state is then not restored.
"""
from __future__ import annotations

import random
from typing import Dict

import numpy as np
import torch
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker


def capture() -> Dict:
    """The state of every stream on this rank."""
    version, key, gauss = random.getstate()
    np_name, np_key, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "python": {"version": version, "state": torch.tensor(key, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": np_name, "key": torch.from_numpy(np_key.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }


def restore(state: Dict) -> None:
    """Put back what `capture()` returned."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def layout_key() -> Dict[str, int]:
    """Who shares this rank's streams: same pipeline and tensor rank, any data-parallel rank."""
    return {"pp": mpu.get_pipeline_model_parallel_rank(), "tp": mpu.get_tensor_model_parallel_rank(),
            "pp_size": mpu.get_pipeline_model_parallel_world_size(), "tp_size": mpu.get_tensor_model_parallel_world_size(),
            "dp": mpu.get_data_parallel_rank()}


def sharded(state: Dict):
    """`state` as a megatron-core ShardedObject: one shard per (PP, TP) rank, DP ranks are replicas."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    k = layout_key()
    return ShardedObject("rng_state", state, (k["pp_size"], k["tp_size"]), (k["pp"], k["tp"]), replica_id=k["dp"])
