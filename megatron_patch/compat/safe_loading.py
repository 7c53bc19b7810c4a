"""Loading a checkpoint must not execute code: two places where torch.distributed.checkpoint (DCP)
unpickles without restriction, made safe.

Both megatron-core's dist_checkpointing (torch_dist format) and our ZeRO-2 checkpoints are DCP
directories, and torch 2.11 reads two kinds of pickles from them without a safety net:

1. `torch/distributed/checkpoint/filesystem.py: FileSystemReader.read_metadata` reads the `.metadata`
   file with a bare `pickle.load`: a planted `.metadata` runs arbitrary code when the checkpoint is
   opened. Patched: that module's `pickle` name is replaced by a stand-in whose `load` allows only the
   classes DCP metadata is made of (torch.distributed.checkpoint's metadata dataclasses and enums,
   torch.Size, dtypes, layouts, memory formats) and refuses anything else, naming it.
2. `torch/distributed/checkpoint/default_planner.py: DefaultLoadPlanner.load_bytes` unpickles every
   non-tensor object (RNG state, optimizer hyper-parameters, megatron-core's common state) with
   `torch.load(..., weights_only=False)`. Patched to `weights_only=True`; megatron-core registers the
   few extra classes its own objects need with torch.serialization when it is imported.

megatron-core 0.19.2's dist_checkpointing goes through both (its readers and MCoreLoadPlanner inherit them).
"""
from __future__ import annotations

import io
import pickle
import types

import torch

from .registry import register, replace

_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                     "torch.distributed.checkpoint.planner")
_SAFE_GLOBALS = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                 ("builtins", "slice"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
                 ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}
_SHIM_NAME = "megatron_patch.compat.safe_pickle"


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file holds a pickled object that loading would have to execute."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in _METADATA_MODULES or (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"refused to unpickle {module}.{name}: a checkpoint's .metadata holds only "
                                    f"torch.distributed.checkpoint metadata, and loading this would run its code")


def check_metadata(checkpoint: str) -> None:
    """Unpickle `checkpoint/.metadata` through the allow-list, raising UnsafeCheckpointError (DCP's own
    reader catches every error of read_metadata and reports only that the metadata is missing)."""
    import os

    path = os.path.join(checkpoint, ".metadata")
    if os.path.isfile(path):
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()


def _safe_pickle_module() -> types.ModuleType:
    """A stand-in for `pickle` inside DCP's filesystem module: restricted `load`, the real `dump`."""
    shim = types.ModuleType(_SHIM_NAME)
    shim.dump, shim.dumps, shim.HIGHEST_PROTOCOL = pickle.dump, pickle.dumps, pickle.HIGHEST_PROTOCOL
    shim.UnpicklingError = pickle.UnpicklingError
    shim.load = lambda f, **kw: _MetadataUnpickler(f).load()
    shim.loads = lambda b, **kw: _MetadataUnpickler(io.BytesIO(b)).load()
    return shim


@register(upstream="torch/distributed/checkpoint/filesystem.py:FileSystemReader.read_metadata",
          fixes="reads a checkpoint's .metadata with a bare pickle.load, so a planted file runs code: unpickle it "
                "through an allow-list of DCP's metadata classes instead",
          fingerprint="8586ce344a523602")
def restrict_dcp_metadata_unpickling() -> None:
    """FileSystemReader.read_metadata unpickles `.metadata` through an allow-list."""
    from torch.distributed.checkpoint import filesystem

    replace(filesystem, "pickle", _safe_pickle_module())


@register(upstream="torch/distributed/checkpoint/default_planner.py:DefaultLoadPlanner.load_bytes",
          fixes="unpickles every non-tensor checkpoint object with torch.load(weights_only=False): load it with "
                "weights_only=True (megatron-core registers the few classes its objects need)",
          fingerprint="666701f9808c4bc2")
def load_dcp_objects_weights_only() -> None:
    """DefaultLoadPlanner.load_bytes unpickles with `torch.load(weights_only=True)`."""
    from torch.distributed.checkpoint import default_planner

    import megatron.core  # noqa: F401  (registers megatron-core's safe globals with torch.serialization)

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

    replace(default_planner.DefaultLoadPlanner, "load_bytes", load_bytes)
