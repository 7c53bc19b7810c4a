"""Run megatron-core without a GPU: gloo process groups plus a small layer that redirects the CUDA calls
megatron-core makes to the CPU.

megatron-core assumes CUDA throughout. On a machine without a GPU (laptops, CI) `enable()` redirects:

  1. `torch.cuda.current_device()` -> 0, and any tensor factory / `.to()` given a CUDA device
     (`"cuda"`, `"cuda:0"`, `torch.device("cuda")`, or an integer index) -> CPU, through a global
     TorchFunctionMode;
  2. `torch.cuda.synchronize`, `Tensor.cuda`, `Tensor.record_stream` -> no-ops;
  3. the CUDA RNG state API (`get/set_rng_state`, `manual_seed`, and megatron-core's tensor-parallel RNG
     tracker helpers) -> the CPU generator, so dropout forks still work per TP rank;
  4. `torch.cuda.current_stream/default_stream/Stream/Event/stream` -> inert objects (DDP's bucketed
     gradient reduction and Megatron-FSDP's pipelines call them);
  5. `Tensor.type()` -> reports `torch.cuda.*Tensor` names, because megatron-core's optimizer checks them;
  6. `DeviceMesh.from_group(..., "cuda")` -> a CPU mesh (Megatron-FSDP / torch FSDP2).

Tested with megatron-core 0.19.2 and torch 2.11.0; other versions log a warning, since each redirect
mirrors a call site of that release. `enable()` is idempotent and only ever used when
`torch.cuda.is_available()` is False; on a GPU nothing here runs.
"""
from __future__ import annotations

import contextlib
import logging
import warnings

import torch

TESTED_MEGATRON_CORE = ("0.19.2",)
_ENABLED = False
logger = logging.getLogger(__name__)


def _is_cuda_device(d) -> bool:
    if isinstance(d, str):
        return d.startswith("cuda")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return isinstance(d, int) and not isinstance(d, bool)  # a bare index means a CUDA device


class _CudaToCpu(torch.overrides.TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


class _Event:
    def __init__(self, *a, **k) -> None:
        pass

    def record(self, *a, **k) -> None:
        pass

    def wait(self, *a, **k) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class _Stream:
    def __init__(self, *a, **k) -> None:
        pass

    def wait_event(self, *a, **k) -> None:
        pass

    def wait_stream(self, *a, **k) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event=None):
        return event or _Event()


_STREAM = _Stream()


def enable() -> None:
    """Install the redirections (once per process). Call before building megatron-core objects."""
    global _ENABLED
    if _ENABLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("cpu_backend.enable() is for machines without a GPU; this one has CUDA")
    import megatron.core

    version = getattr(megatron.core, "__version__", "?")
    if version.split("+")[0] not in TESTED_MEGATRON_CORE:
        warnings.warn(f"megatron_patch's CPU backend was tested with megatron-core {TESTED_MEGATRON_CORE}, "
                      f"not {version}; if a CUDA call fails on CPU, add its redirect to megatron_patch/parallel/cpu_backend.py")

    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls it; the CPU generator is already seeded
    cuda.current_stream = lambda *a, **k: _STREAM
    cuda.default_stream = lambda *a, **k: _STREAM
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.record_stream = lambda self, *a, **k: None

    original_type = torch.Tensor.type

    def _type(self, dtype=None, non_blocking=False, **kw):
        if dtype is None:
            name = original_type(self)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return original_type(self, dtype, non_blocking, **kw)

    torch.Tensor.type = _type

    import megatron.core.tensor_parallel.random as tp_random

    tp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)

    from torch.distributed.device_mesh import DeviceMesh

    original_from_group = DeviceMesh.from_group

    def _from_group(group, device_type, *a, **k):
        return original_from_group(group, "cpu" if str(device_type).startswith("cuda") else device_type, *a, **k)

    DeviceMesh.from_group = staticmethod(_from_group)

    # The tracker's fork() warns when the CPU generator changes inside it; here the "CUDA" generator *is*
    # the CPU generator, so that warning is always a false alarm.
    logging.getLogger(tp_random.__name__).addFilter(lambda r: "CPU RNG state changed" not in r.getMessage())

    _CudaToCpu().__enter__()  # stays active for the life of the process
    _ENABLED = True
    logger.warning("no GPU found: running megatron-core on the CPU with gloo (megatron_patch.parallel.cpu_backend)")


def is_enabled() -> bool:
    return _ENABLED
