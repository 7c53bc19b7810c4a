"""ONNX Runtime training (ORTModule) on torch 2.11: three workarounds, applied only under
--onnx-runtime-training (megatron_patch/accelerations/onnx_runtime.py), before ORTModule is imported.

`onnxruntime-training-cpu==1.19.2` is the last release of ONNX Runtime's training package and the only
one for Python 3.12; it was written against torch 2.1-2.4. Measured with torch 2.11:

1. `import onnxruntime.training.ortmodule` fails: ortmodule/_custom_op_symbolic_registry.py and
   _custom_autograd_function_exporter.py import `torch.onnx._internal.jit_utils`, `torch.onnx._globals`
   and `torch.onnx._type_utils`, which torch 2.9 moved under `torch.onnx._internal.torchscript_exporter`.
   Patched: the moved modules are registered under their old names as well.
2. Exporting the model fails: ortmodule/_graph_transition_manager.py calls `torch.onnx.export(...)` with
   TorchScript-exporter arguments (training=, dynamic_axes=, keep_initializers_as_inputs=...), but torch
   2.9+ defaults to `dynamo=True` (the torch.export-based exporter, which ORTModule cannot consume).
   Patched: `torch.onnx.export` defaults to `dynamo=False` (an explicit `dynamo=` still wins). This holds
   for the whole process once --onnx-runtime-training is on; other exports in it still work (the
   TorchScript exporter writes valid ONNX) but pass `dynamo=True` to get the new exporter.
3. ORTModule's `torch_interop_utils` C++ extension (support for custom torch.autograd.Functions inside
   the exported graph, "PythonOp") compiles but does not load: it `dynamic_cast`s to
   `torch::autograd::PyNode`, whose typeinfo torch 2.11's libtorch_python no longer exports
   ("undefined symbol: _ZTIN5torch8autograd6PyNodeE"), and ORTModule imports it unconditionally.
   Patched: custom-autograd support is switched off (ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0) and a stand-in
   module takes the extension's place; a model whose forward calls a custom autograd.Function then fails
   to export with ONNX Runtime's error (fallback is disabled), instead of every model failing to import.
   Hugging Face gradient checkpointing does not need it (ORTModule unrolls torch.utils.checkpoint while exporting).

Tested with onnxruntime-training-cpu 1.19.2 and torch 2.11.0 (CPU).
"""
from __future__ import annotations

import functools
import os
import sys
import types

import torch

from .registry import register, replace

TESTED_ORT = "onnxruntime-training-cpu 1.19.2, torch 2.11.x"
_MOVED = ("jit_utils", "_globals", "_type_utils")
_INTEROP = "onnxruntime.training.ortmodule.torch_cpp_extensions.torch_interop_utils"


@register(upstream=("torch/onnx/_internal/torchscript_exporter/jit_utils.py:GraphContext",
                    "torch/onnx/_internal/torchscript_exporter/_globals.py:_InternalGlobals",
                    "torch/onnx/_internal/torchscript_exporter/_type_utils.py:JitScalarType"),
          fixes="onnxruntime-training 1.19.2 imports torch.onnx._internal.jit_utils, torch.onnx._globals and "
                "torch.onnx._type_utils, which torch 2.9+ moved under torch.onnx._internal.torchscript_exporter: "
                "register the moved modules under their old names too",
          fingerprint="c31ca12f03c5804a", tested=TESTED_ORT)
def alias_moved_torch_onnx_modules() -> None:
    """`torch.onnx._internal.jit_utils`, `torch.onnx._globals`, `torch.onnx._type_utils` importable again."""
    import importlib

    import torch.onnx._internal as internal

    owners = {"jit_utils": ("torch.onnx._internal", internal), "_globals": ("torch.onnx", torch.onnx),
              "_type_utils": ("torch.onnx", torch.onnx)}
    for name in _MOVED:
        moved = importlib.import_module(f"torch.onnx._internal.torchscript_exporter.{name}")
        package, owner = owners[name]
        sys.modules.setdefault(f"{package}.{name}", moved)
        if not hasattr(owner, name):
            setattr(owner, name, moved)


@register(upstream="torch/onnx/__init__.py:export",
          fixes="torch 2.9+ torch.onnx.export defaults to dynamo=True, while ORTModule's exporter call passes "
                "TorchScript-exporter arguments and needs that exporter: default dynamo=False (explicit wins)",
          fingerprint="732d0e9401601df1", tested=TESTED_ORT)
def torchscript_exporter_by_default() -> None:
    """`torch.onnx.export(...)` without `dynamo=` uses the TorchScript exporter."""
    export = torch.onnx.export

    @functools.wraps(export)
    def export_torchscript_by_default(*args, **kwargs):
        kwargs.setdefault("dynamo", False)
        return export(*args, **kwargs)

    replace(torch.onnx, "export", export_torchscript_by_default)


@register(upstream="torch/_C:_FunctionBase",
          fixes="ORTModule's torch_interop_utils extension dynamic_casts to torch::autograd::PyNode (the C++ node of "
                "a custom autograd.Function, _FunctionBase), whose typeinfo torch 2.11 no longer exports, so it does "
                "not load and ORTModule does not import: switch custom-autograd support off and stand in for it",
          fingerprint="4d8bcf240839f917", tested=TESTED_ORT)
def stand_in_for_torch_interop_utils() -> None:
    """ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0 and a stand-in `torch_interop_utils` module."""
    os.environ["ORTMODULE_ENABLE_CUSTOM_AUTOGRAD"] = "0"
    if _INTEROP in sys.modules:
        return
    stub = types.ModuleType(_INTEROP, "stand-in (megatron_patch.compat.onnx_runtime): the real extension does not "
                                      "load on torch 2.11; custom autograd.Functions are unsupported")

    def unsupported(*args, **kwargs):
        raise RuntimeError("ORTModule: custom torch.autograd.Function support (torch_interop_utils) is unavailable "
                           "on torch 2.11 (see megatron_patch/compat/onnx_runtime.py)")

    stub.get_custom_function_forward_runner = stub.get_custom_function_backward_runner = unsupported
    stub.clear_all_grad_fns = lambda: None
    sys.modules[_INTEROP] = stub
