"""`--onnx-runtime-training`: train through ONNX Runtime's ORTModule (an optional extra).

ORTModule exports the model's forward to ONNX on the first call, builds forward and gradient graphs,
optimizes them, and runs both in ONNX Runtime; the parameters stay torch tensors that torch's optimizer
updates. What we know about the package (measured, see compat/onnx_runtime.py):

* Only `onnxruntime-training-cpu==1.19.2` (the last release) exists for Python 3.12: CPU only, no GPU build.
* On torch 2.11 it needs the compatibility layer in megatron_patch/compat/onnx_runtime.py.
* Its two C++ torch extensions are compiled on first use into the installed package (a few minutes on 2
  cores); with several workers, local rank 0 builds them while the others wait.
* By default ORTModule silently falls back to plain PyTorch when anything fails. We set
  ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE: the switch trains through ONNX Runtime or stops with the error,
  never trains without it while claiming to.
* ORTModule fixes the model's input signature at export: calling it in training mode with other keyword
  arguments (e.g. without `labels`) fails; evaluation (`model.eval()`) exports a graph of its own.
* The export traces the model under the autocast of its first forward: with --mixed-precision the graph holds
  casts to fp16 around the matrix multiplies and ONNX Runtime runs them in fp16 (measured on a 2-layer BERT,
  hidden 256: 37 fp16 casts in the graph, fp16 logits, the loss after 6 steps 0.172789 against PyTorch's fp16
  autocast 0.172783 and fp32 0.172707: differences a 4-decimal log line does not show; per step 1.7x the time of
  the fp32 graph on one CPU thread, where eager fp16 takes 24x). Autocast after the export changes nothing: the
  first forward must run inside `precision.autocast()`, as the templates do.
* It runs under DDP, fp16/bf16 autocast and activation checkpointing. With FSDP2 (ZeRO-2/3) it is refused
  in check_combination: ORTModule feeds its graph the parameters it saw at export, while FSDP2 swaps every
  layer's parameters between shards and gathered tensors around each forward and backward.
"""
from __future__ import annotations

import glob
import importlib.util
import logging
import os
import subprocess
import sys
from typing import Optional, Tuple

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# The only ONNX Runtime training build for Python 3.12 (its last release; CPU only).
PIP_ORT = "pip install onnxruntime-training-cpu==1.19.2"

_BUILD = ("from megatron_patch.compat import apply_onnx_runtime_fixes; apply_onnx_runtime_fixes(); "
          "from onnxruntime.training.ortmodule.torch_cpp_extensions import install; "
          "install.build_torch_cpp_extensions()")


def ort_available() -> bool:
    """True when ONNX Runtime's training package (onnxruntime.training) is installed. The inference-only
    `onnxruntime` package has no ORTModule."""
    try:
        return importlib.util.find_spec("onnxruntime.training") is not None
    except (ImportError, ValueError):
        return False


def _extension_dir() -> Optional[str]:
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "training", "ortmodule", "torch_cpp_extensions")


def extensions_built() -> bool:
    path = _extension_dir()
    return bool(path and glob.glob(os.path.join(path, "*.so")))


def build_extensions() -> None:
    """Compile ORTModule's torch C++ extensions into the installed package (what `python -m
    torch_ort.configure` does), in a child process so this one imports ORTModule only afterwards."""
    logger.warning("--onnx-runtime-training: compiling ONNX Runtime's torch C++ extensions once into %s "
                   "(a few minutes)", _extension_dir())
    proc = subprocess.run([sys.executable, "-c", _BUILD], capture_output=True, text=True)
    if proc.returncode != 0 or not extensions_built():
        raise RuntimeError(f"--onnx-runtime-training: compiling ONNX Runtime's torch C++ extensions failed "
                           f"(exit {proc.returncode}); a C++ compiler and torch's headers are needed. Output:\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")


def _ensure_extensions() -> None:
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    builder = int(os.environ.get("LOCAL_RANK", dist.get_rank() if distributed else 0)) == 0
    if builder and not extensions_built():
        if "onnxruntime.training.ortmodule" in sys.modules:
            raise RuntimeError("--onnx-runtime-training: ORTModule was imported before its C++ extensions were "
                               "built, and it does not look again; restart the process")
        build_extensions()
    if distributed:
        dist.barrier()
    if not extensions_built():
        raise RuntimeError("--onnx-runtime-training: ONNX Runtime's torch C++ extensions are missing on this node")


def apply_onnx_runtime(model: torch.nn.Module, device: Optional[torch.device] = None) -> Tuple[torch.nn.Module, str]:
    if not ort_available():
        raise RuntimeError(f"--onnx-runtime-training needs ONNX Runtime's training package: `{PIP_ORT}`, or use "
                           f"--torch-compile instead")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if device.type != "cpu":
        import onnxruntime

        provider = {"cuda": "CUDAExecutionProvider"}.get(device.type, f"{device.type} execution provider")
        if provider not in onnxruntime.get_available_providers():
            raise RuntimeError(f"--onnx-runtime-training: the installed ONNX Runtime ({onnxruntime.__version__}, "
                               f"providers {', '.join(onnxruntime.get_available_providers())}) cannot run on "
                               f"{device.type}; `{PIP_ORT}` is the only build for Python 3.12 and runs on the CPU "
                               f"only: use --torch-compile on {device.type}")
    from megatron_patch.compat import apply_onnx_runtime_fixes

    os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"  # read when each ORTModule is built
    apply_onnx_runtime_fixes()
    _ensure_extensions()
    from onnxruntime.training.ortmodule import ORTModule

    import onnxruntime

    note = ""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa" and hasattr(model, "set_attn_implementation"):
        # torch's ONNX export of scaled_dot_product_attention writes its dropout as a Dropout node without the
        # mask output, and ORT's gradient builder needs that output (it fails on any model with attention
        # dropout); the eager attention uses nn.Dropout, which exports both outputs
        model.set_attn_implementation("eager")
        note = "; attention switched from SDPA to eager for the export"
    return ORTModule(model), (f"ONNX Runtime {onnxruntime.__version__}: ORTModule trains the model's exported "
                              f"graph (fallback to PyTorch disabled){note}")
