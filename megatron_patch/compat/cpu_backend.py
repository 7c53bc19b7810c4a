"""Run megatron-core without a GPU: redirect the CUDA calls it makes to the CPU (with gloo process groups).

megatron-core assumes CUDA throughout. Each function below redirects one family of CUDA calls and names the
megatron-core call sites it serves. They are applied together, in the order of
`megatron_patch.compat.CPU_BACKEND`, by `megatron_patch.compat.apply_cpu_backend()`, and only on machines
where `torch.cuda.is_available()` is False; on a GPU nothing here runs.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from .registry import original, register, replace

CUDA_CALLS = "the CUDA call fails without a GPU (no CUDA driver)"


@register(upstream="torch/cuda/__init__.py:current_device",
          fixes=f"{CUDA_CALLS}; megatron-core asks for the device index everywhere: answer 0 (the CPU)",
          fingerprint="6e9804168a5c7f8c")
def cuda_current_device_is_zero() -> None:
    """`torch.cuda.current_device()` -> 0. Serves megatron-core's `device=torch.cuda.current_device()`
    allocations (tensor_parallel/layers.py weights, distributed/param_and_grad_buffer.py buffers,
    optimizer/optimizer.py and distrib_optimizer.py, pipeline_parallel/p2p_communication.py,
    mcore_fsdp_adapter.py's default device); the index then reaches `cuda_device_arguments_to_cpu`."""
    replace(torch.cuda, "current_device", lambda: 0)


@register(upstream="torch/cuda/__init__.py:synchronize", fixes=f"{CUDA_CALLS}; on the CPU there is nothing to wait for",
          fingerprint="7055e6143ffee8f1")
def cuda_synchronize_is_noop() -> None:
    """`torch.cuda.synchronize()` -> no-op. Serves parallel_state.py, timers.py, distributed_data_parallel.py,
    Megatron-FSDP's param_and_grad_buffer.py and dist_checkpointing's strategies."""
    replace(torch.cuda, "synchronize", lambda *a, **k: None)


@register(upstream=("torch/cuda/random.py:get_rng_state", "torch/cuda/random.py:set_rng_state",
                    "torch/cuda/random.py:manual_seed", "torch/cuda/random.py:manual_seed_all"),
          fixes="the CUDA RNG state API needs a CUDA generator: use the CPU generator instead",
          fingerprint="f3799a6764cd3c0e")
def cuda_rng_uses_cpu_generator() -> None:
    """`torch.cuda.get_rng_state/set_rng_state/manual_seed` -> the CPU generator; `manual_seed_all` -> no-op
    (torch.manual_seed calls it, and the CPU generator is already seeded). Serves
    tensor_parallel/random.py (model_parallel_cuda_manual_seed, the RNG tracker), rerun_state_machine.py and
    Megatron-FSDP's utils.py RNG tracker."""
    cuda = torch.cuda
    get_state = lambda *a, **k: torch.get_rng_state()  # noqa: E731
    replace(cuda, "get_rng_state", get_state)
    replace(cuda.random, "get_rng_state", get_state)
    replace(cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    replace(cuda, "manual_seed", lambda seed: torch.manual_seed(seed))
    replace(cuda, "manual_seed_all", lambda seed: None)


@register(upstream=("megatron/core/tensor_parallel/random.py:_get_cuda_rng_state",
                    "megatron/core/tensor_parallel/random.py:_set_cuda_rng_state"),
          fixes="megatron-core's tensor-parallel RNG helpers read/write the CUDA generator directly "
                "(torch.cuda.default_generators): use the CPU generator, so dropout forks still work per TP rank",
          fingerprint="778c9c3c76ceeadf")
def megatron_tp_rng_uses_cpu_generator() -> None:
    """megatron-core's `_get_cuda_rng_state/_set_cuda_rng_state` -> the CPU generator. Serves
    tensor_parallel/random.py: CudaRNGStatesTracker.add/fork, activation checkpointing's RNG replay,
    convert_cuda_rng_state."""
    import megatron.core.tensor_parallel.random as tp_random

    replace(tp_random, "_get_cuda_rng_state",
            lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state())
    replace(tp_random, "_set_cuda_rng_state",
            lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))


@register(upstream="megatron/core/tensor_parallel/random.py:CudaRNGStatesTracker.fork",
          fixes="fork() warns 'CPU RNG state changed within GPU RNG context' when the CPU generator moves inside "
                "it; here the 'CUDA' generator *is* the CPU generator, so that warning is always a false alarm: "
                "filter it from megatron-core's log",
          fingerprint="6821e1e397253d43")
def quiet_tp_rng_fork_warning() -> None:
    """A logging filter on megatron.core.tensor_parallel.random's logger (CudaRNGStatesTracker.fork)."""
    import megatron.core.tensor_parallel.random as tp_random

    log = logging.getLogger(tp_random.__name__)
    if not any(getattr(f, "_megatron_patch", False) for f in log.filters):
        def drop(record: logging.LogRecord) -> bool:
            return "CPU RNG state changed" not in record.getMessage()

        drop._megatron_patch = True
        log.addFilter(drop)


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


@register(upstream=("torch/cuda/__init__.py:current_stream", "torch/cuda/__init__.py:default_stream",
                    "torch/cuda/__init__.py:stream", "torch/cuda/streams.py:Stream", "torch/cuda/streams.py:Event"),
          fixes=f"{CUDA_CALLS}; on the CPU every operation is already ordered: inert streams and events",
          fingerprint="8a3edb73dcfd66be")
def cuda_streams_and_events_are_inert() -> None:
    """`torch.cuda.current_stream/default_stream/Stream/Event/stream` -> inert objects. Serves
    distributed/param_and_grad_buffer.py (DDP's bucketed gradient reduction), Megatron-FSDP's
    param_and_grad_buffer.py (its all-gather/reduce-scatter pipelines), pipeline_parallel/utils.py,
    optimizer/cpu_offloading/hybrid_optimizer.py."""
    cuda = torch.cuda
    replace(cuda, "current_stream", lambda *a, **k: _STREAM)
    replace(cuda, "default_stream", lambda *a, **k: _STREAM)
    replace(cuda, "Stream", _Stream)
    replace(cuda, "Event", _Event)
    replace(cuda, "stream", lambda s=None: contextlib.nullcontext())


@register(upstream="torch/_C:TensorBase.cuda", fixes=f"{CUDA_CALLS}; the tensor stays where it is (the CPU)",
          fingerprint="4e3571d6f4214e99")
def tensor_cuda_is_identity() -> None:
    """`Tensor.cuda()` -> the tensor itself. Serves optimizer/optimizer.py (loading state), distrib_optimizer.py,
    tensor_parallel/data.py (broadcast_data), language_module.py (tied embeddings), dist_checkpointing's
    exchange_utils.py, Megatron-FSDP's uneven_dtensor.py."""
    replace(torch.Tensor, "cuda", lambda self, *a, **k: self)


@register(upstream="torch/_C:TensorBase.record_stream", fixes=f"{CUDA_CALLS}; there are no streams on the CPU",
          fingerprint="ab3cb6ef51640383")
def tensor_record_stream_is_noop() -> None:
    """`Tensor.record_stream()` -> no-op. Serves pipeline_parallel/utils.py and combined_1f1b.py (overlapped
    schedules) and the MoE token dispatchers."""
    replace(torch.Tensor, "record_stream", lambda self, *a, **k: None)


@register(upstream=("torch/_C:TensorBase.type",
                    "megatron/core/optimizer/optimizer.py:Float16OptimizerWithFloat16Params.__init__",
                    "megatron/core/optimizer/distrib_optimizer.py:DistributedOptimizer._build_model_and_main_param_groups",
                    "megatron/core/optimizer/clip_grads.py:clip_grad_by_total_norm_fp32"),
          fixes="megatron-core's optimizer accepts only parameters whose type() is 'torch.cuda.FloatTensor/"
                "HalfTensor/BFloat16Tensor' and raises on CPU tensors: report CPU tensors under those names",
          fingerprint="f9ec15d53435ea47")
def tensor_type_reports_cuda() -> None:
    """`Tensor.type()` (no arguments) -> the `torch.cuda.*Tensor` name; with a dtype it converts as before.
    Serves the checks in Float16OptimizerWithFloat16Params.__init__, DistributedOptimizer.__init__ and
    _build_model_and_main_param_groups, clip_grads.clip_grad_by_total_norm_fp32."""
    upstream_type = original(torch.Tensor, "type")

    def tensor_type(self, dtype=None, non_blocking=False, **kw):
        if dtype is None:
            name = upstream_type(self)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return upstream_type(self, dtype, non_blocking, **kw)

    replace(torch.Tensor, "type", tensor_type)


@register(upstream=("torch/distributed/device_mesh.py:DeviceMesh.from_group",
                    "megatron/core/distributed/fsdp/mcore_fsdp_adapter.py:FullyShardedDataParallel._init_dist_index",
                    "megatron/core/distributed/torch_fully_sharded_data_parallel.py:"
                    "TorchFullyShardedDataParallel.__init__"),
          fixes="megatron-core builds its device meshes with DeviceMesh.from_group(group, 'cuda'), which needs CUDA: "
                "build a CPU mesh instead", fingerprint="a266b962a83d714a")
def device_mesh_from_group_on_cpu() -> None:
    """`DeviceMesh.from_group(..., "cuda")` -> a CPU mesh. Serves Megatron-FSDP's adapter (_init_dist_index)
    and TorchFullyShardedDataParallel (torch FSDP2)."""
    from torch.distributed.device_mesh import DeviceMesh

    upstream_from_group = original(DeviceMesh, "from_group")

    def from_group(group, device_type, *a, **k):
        return upstream_from_group(group, "cpu" if str(device_type).startswith("cuda") else device_type, *a, **k)

    replace(DeviceMesh, "from_group", staticmethod(from_group))


@register(upstream=("megatron/core/utils.py:local_multi_tensor_l2_norm",
                    "megatron/core/optimizer/clip_grads.py:get_grad_norm_fp32"),
          fixes="without apex/Transformer Engine, megatron-core's gradient norm takes torch.norm of each fp32 gradient, "
                "which on the CPU can be off by 5e-4 relative (measured: BERT's 30592 x 64 word-embedding gradient), "
                "so layouts that slice a tensor differently (TP) log different norms and clip differently: accumulate "
                "each norm in float64",
          fingerprint="c496bc1a97decbd0")
def precise_grad_norm_on_cpu() -> None:
    """clip_grads' `l2_norm_impl`, when it is megatron-core's local (torch) one -> the same with each tensor's norm
    accumulated in float64 (torch.linalg.vector_norm(dtype=float64)). Serves get_grad_norm_fp32: the logged grad
    norm and --clip-grad. The result stays a float32 tensor of one element, as upstream returns it."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    if original(clip_grads, "l2_norm_impl") is not local_multi_tensor_l2_norm:
        return  # apex's or Transformer Engine's kernel

    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        squares = sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for ts in tensor_lists for t in ts)
        return torch.tensor([squares ** 0.5], dtype=torch.float), None

    replace(clip_grads, "l2_norm_impl", l2_norm)


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


_MODE = None


@register(upstream="torch/overrides.py:TorchFunctionMode",
          fixes="megatron-core allocates with device='cuda', device=torch.cuda.current_device() and .to(cuda device): "
                "a process-wide TorchFunctionMode rewrites those device arguments to the CPU",
          fingerprint="c65221baa8e5846b")
def cuda_device_arguments_to_cpu() -> None:
    """Every tensor factory / `.to()` given a CUDA device (`"cuda"`, `"cuda:0"`, `torch.device("cuda")` or an
    integer index) -> the CPU. Serves all of megatron-core's allocations (layers, buffers, optimizer, p2p
    communication, dist_checkpointing). Entered once and never exited: it stays active for the process."""
    global _MODE
    if _MODE is None:
        _MODE = _CudaToCpu()
        _MODE.__enter__()


@register(upstream=("torch/autograd/function.py:BackwardCFunction.apply",
                    "megatron/core/tensor_parallel/mappings.py:_AllToAll.forward",
                    "megatron/core/tensor_parallel/mappings.py:_reduce_scatter_along_first_dim",
                    "megatron/core/tensor_parallel/mappings.py:_gather_along_first_dim"),
          fixes="torch's autograd engine runs backward without the torch-function-mode stack, so "
                "`cuda_device_arguments_to_cpu` does not see the device='cuda' allocations made inside custom "
                "autograd Functions' backward (megatron-core's all-to-all, reduce-scatter and all-gather buffers: "
                "MoE expert parallelism, sequence parallelism) and they fail without a CUDA driver: run every "
                "custom Function's backward under that mode too",
          fingerprint="071dc17dd5178cea")
def cuda_device_arguments_to_cpu_in_backward() -> None:
    """`BackwardCFunction.apply` (what the autograd engine calls for a custom Function's backward) -> the same,
    inside the process-wide `_CudaToCpu` mode when the mode stack is empty (it always is in backward). Serves
    tensor_parallel/mappings.py: _AllToAll.backward (the MoE alltoall dispatcher, expert parallelism) and the
    backward of gather_from_sequence_parallel_region / reduce_scatter_to_sequence_parallel_region (the MoE
    allgather dispatcher over TP x EP, sequence parallelism). Needs `cuda_device_arguments_to_cpu` first."""
    from torch.autograd.function import BackwardCFunction

    upstream_apply = original(BackwardCFunction, "apply")

    def apply(self, *args):
        if _MODE is not None and torch._C._len_torch_function_stack() == 0:
            with _MODE:
                return upstream_apply(self, *args)
        return upstream_apply(self, *args)

    replace(BackwardCFunction, "apply", apply)
