"""Every workaround for megatron-core / torch internals, in one place.

Tested with megatron-core 0.19.2 and torch 2.11.x (`versions.TESTED`). `check_versions()` compares the
installed versions once per process and, if they differ, warns once, naming both.

Entry points
------------
check_versions()             once, where the process starts (megatron_patch.parallel.initialize), before any patch
apply_cpu_backend()          machines without a GPU only: run megatron-core on the CPU (gloo)
apply_gpu_fixes()            machines with a GPU (megatron_patch.parallel.initialize)
apply_megatron_fsdp_fixes()  before the first Megatron-FSDP (ZeRO-2) model is built (models/build.py)
apply_safe_loading()         before any checkpoint is read (training/checkpoint: the Checkpointer applies it)
apply_onnx_runtime_fixes()   --onnx-runtime-training only, before ORTModule is imported (accelerations/onnx_runtime.py)
quiet_known_noise()          where a process starts (quiet.py): known harmless warnings of megatron-core, torch and
                             transformers hidden, or shown by rank 0 only; not a patch (nothing upstream is replaced)
The apply functions are idempotent and call check_versions() themselves.

The patches, in the order they are applied
------------------------------------------
apply_cpu_backend() (cpu_backend.py), order `CPU_BACKEND`:
  1. cuda_current_device_is_zero          torch.cuda.current_device -> 0
  2. cuda_synchronize_is_noop             torch.cuda.synchronize -> no-op
  3. cuda_rng_uses_cpu_generator          torch.cuda RNG state API -> the CPU generator
  4. megatron_tp_rng_uses_cpu_generator   megatron-core's tensor_parallel.random _get/_set_cuda_rng_state -> CPU
  5. quiet_tp_rng_fork_warning            filter the tracker's false "CPU RNG state changed" warning
  6. cuda_streams_and_events_are_inert    torch.cuda streams/events -> inert objects
  7. tensor_cuda_is_identity              Tensor.cuda -> the tensor itself
  8. tensor_record_stream_is_noop         Tensor.record_stream -> no-op
  9. tensor_type_reports_cuda             Tensor.type() -> "torch.cuda.*Tensor" (megatron-core's optimizer checks it)
 10. device_mesh_from_group_on_cpu        DeviceMesh.from_group(..., "cuda") -> a CPU mesh
 11. precise_grad_norm_on_cpu             the gradient norm (logged, clipping) accumulated in float64 on the CPU
 12. moe_alltoall_splits_as_numpy         (moe.py) the MoE alltoall dispatcher's split sizes -> numpy, as on a GPU
 13. moe_uneven_gather_scatter_on_gloo    (moe.py) uneven all-gather/reduce-scatter (alltoall dispatcher, ETP > 1) on gloo
 14. cuda_device_arguments_to_cpu         a process-wide TorchFunctionMode: device="cuda"/index -> "cpu"
 15. cuda_device_arguments_to_cpu_in_backward   the same mode inside custom autograd Functions' backward
  Why this order: all of them must be in place before megatron-core builds anything (process groups,
  model_parallel_cuda_manual_seed, models), so initialize() applies them before init_process_group.
  The RNG redirects (3, 4) come before the tracker's warning filter (5), which is only right once the
  "CUDA" generator is the CPU one. Tensor.type (9) and DeviceMesh.from_group (10) wrap upstream's
  originals, which the registry keeps, so re-applying never wraps a wrapper; 11 is independent of the others.
  The MoE patches (12, 13) act only on models with megatron-core MoE layers (--num-experts). The
  TorchFunctionMode (14) comes last but one: it intercepts every torch call from then on, so the patching
  itself runs under plain torch; the autograd engine runs backward without it, so 15 (which needs 14's mode)
  re-enters it there.

apply_gpu_fixes() (multi_tensor.py), order `GPU`:
  1. foreach_multi_tensor_fallbacks   megatron-core's local multi-tensor l2 norm / scale -> torch foreach kernels
  2. grad_clip_without_host_sync      clip_grads gets a foreach multi_tensor_scale_tensor: norm kept on the device
  Why: without apex/TE the fallbacks sync the host once per parameter tensor in every gradient norm, and the
  norm itself is read on the host mid-step; they are replaced only where they are upstream's local ones (apex's
  or TE's kernels stay).

apply_megatron_fsdp_fixes() (megatron_fsdp.py), order `MEGATRON_FSDP`:
  1. dp_tp_mesh_from_groups       FSDP adapter's (dp, tp) mesh from the real groups (PP > 1)
  2. skip_dtensor_world_check     make_fsdp_dtensor without its world-group check (PP > 1)
  3. fsdp_tied_embedding_grad     tied-embedding gradient all-reduce over uneven FSDP shards (PP > 1)
  Why this order: 1 and 2 act while FullyShardedDataParallel is constructed, 3 at every step's
  finalize_model_grads; they are independent of each other, and all must precede the first construction.

apply_safe_loading() (safe_loading.py), order `SAFE_LOADING`:
  1. restrict_dcp_metadata_unpickling   DCP's .metadata through an allow-list, not a bare pickle.load
  2. load_dcp_objects_weights_only      DCP's non-tensor objects with torch.load(weights_only=True)
  Why: loading a checkpoint must not run code it contains (megatron-core's torch_dist format and our
  ZeRO-2 format are both DCP directories). Independent of each other; both before the first load.

apply_onnx_runtime_fixes() (onnx_runtime.py), order `ONNX_RUNTIME`:
  1. alias_moved_torch_onnx_modules      torch.onnx._internal.jit_utils/_globals/_type_utils under their old names
  2. torchscript_exporter_by_default     torch.onnx.export defaults to dynamo=False (ORTModule's export call)
  3. stand_in_for_torch_interop_utils    custom-autograd support off, a stand-in for the extension that does not load
  Why this order: 1 makes `onnxruntime.training.ortmodule` importable, 2 its export work, 3 its first
  ORTModule construction; all three must precede importing ORTModule, and apply only to processes that
  train with --onnx-runtime-training (onnxruntime-training-cpu 1.19.2 is an optional extra).

Called at their call sites (not applied globally):
  dynamo.py        tp_group_default_without_warning (--compile: models/compile.py, before compiling)
  linear.py        route_linears_through (--gradient-accumulation-fusion: models/wgrad_fusion.py, and --fp8-format:
                   models/float8.py, built chunks)
                   count_linears_without_collective (its log: which linears the fused path takes)
  flash_varlen.py  flash_varlen_attention (torch's varlen flash kernels with attention dropout: --padding-free,
                   accelerations/padding_free.py)
  float8.py        torchao_float8 (torchao's private float8 matmul and casts, pinned: models/float8.py)
  moe.py           route_experts_through (--moe-grouped-gemm: models/grouped_experts.py, built chunks)
                   use_token_dispatcher (the device dispatcher at EP 1: models/moe_dispatch.py)
                   moe_tracked_means (the routers' aux losses per step on the device: training/moe_metrics.py)
                   one_rank_reductions_are_identity, expert_biases_not_sequence_parallel (experts with linear
                   biases: models/gpt.py build_gpt_model)
  optimizer.py     replace_torch_optimizer (LAMB into megatron-core's wrappers), use_fused_adam (GPU),
                   fuse_optimizer_step (--optimizer-step-fusion: training/fused_adam.py, built optimizer),
                   set_param_group_lr_range (resuming: training/checkpoint/checkpointer.py, around loading)
  adam_state.py    fill_empty_adam_state, restore_adam_step, steps_on_param_device, steps_kept_out (checkpointing)
  checkpoint_writer.py write_results_in_process (each torch_dist save: training/checkpoint/torch_dist.py)
                   staged_async_write (--async-save: training/checkpoint/async_save.py)
  megatron_fsdp.py use_distributed_params, copy_main_to_model_params, prepare_uneven_dtensor_state (ZeRO-2 checkpoints),
                   use_raw_params (conversion's verify of a ZeRO-2 checkpoint: conversion/worker.py)
  mla.py           mla_query_projection_without_norm, mla_rotary_key_gradient_over_tp (DeepSeek's MLA on the local
                   spec, TP > 1: models/gpt.py)
  rope.py          llama3_rope_scaling (Llama 3.x RoPE scaling with the model's own frequency bounds: models/gpt.py)
  post_layernorm.py post_layernorm_transformer_layer, drop_final_layernorm, norm_before_embedding_dropout
                   (BERT's post-LN, models/bert.py)

Adding a workaround
-------------------
1. Write one function in the module of its topic (a new one, e.g. `safe_loading.py`, is fine) and decorate it:

       from .registry import register, replace, original

       @register(upstream="torch/distributed/checkpoint/state_dict_loader.py:load",   # what it depends on
                 fixes="one sentence: what upstream does, and what we do instead",
                 fingerprint="")                                                    # filled in at step 3
       def my_fix() -> None:
           replace(owner_module, "name", new_object)   # for monkeypatches: keeps upstream's original

   `upstream` may be a tuple; name each object the patch replaces or relies on, as "path/file.py:Qual.name"
   (for C-implemented torch objects, "torch/_C:TensorBase.method"). A call-site helper (like the Adam
   repairs) is registered the same way and simply called where needed.
2. New module? Import it below (`from . import safe_loading`), so its patches are registered. A global patch
   goes into the order tuple of its entry point (or a new `apply_...` here, documented above).
3. Run `.venv/bin/python -m pytest -q tests/test_compat.py`: the canary for the new patch fails and prints its
   current fingerprint; after checking the upstream code, paste it into `fingerprint=`.
   When upstream changes later, the same canary fails: re-read the upstream code, re-check (or drop) the
   patch, then update the fingerprint and, if the versions change, `versions.TESTED`.
"""
from __future__ import annotations

import logging
import os

import torch

from . import (adam_state, checkpoint_writer, cpu_backend, dynamo, flash_varlen, float8, linear, megatron_fsdp,  # noqa: F401  (registers patches)
               moe, mla, multi_tensor, onnx_runtime, optimizer, post_layernorm, rope, safe_loading)
from .quiet import quiet_known_noise
from .registry import PATCHES, Patch
from .versions import TESTED, UntestedVersionWarning, check_versions

__all__ = ["apply_cpu_backend", "apply_megatron_fsdp_fixes", "check_versions", "cpu_backend_enabled",
           "apply_safe_loading", "PATCHES", "Patch", "TESTED", "UntestedVersionWarning", "CPU_BACKEND", "MEGATRON_FSDP",
           "SAFE_LOADING", "ONNX_RUNTIME", "apply_onnx_runtime_fixes", "APPLIED", "GPU", "apply_gpu_fixes",
           "quiet_known_noise"]

logger = logging.getLogger(__name__)

CPU_BACKEND = (
    cpu_backend.cuda_current_device_is_zero,
    cpu_backend.cuda_synchronize_is_noop,
    cpu_backend.cuda_rng_uses_cpu_generator,
    cpu_backend.megatron_tp_rng_uses_cpu_generator,
    cpu_backend.quiet_tp_rng_fork_warning,
    cpu_backend.cuda_streams_and_events_are_inert,
    cpu_backend.tensor_cuda_is_identity,
    cpu_backend.tensor_record_stream_is_noop,
    cpu_backend.tensor_type_reports_cuda,
    cpu_backend.device_mesh_from_group_on_cpu,
    cpu_backend.precise_grad_norm_on_cpu,
    moe.moe_alltoall_splits_as_numpy,
    moe.moe_uneven_gather_scatter_on_gloo,
    cpu_backend.cuda_device_arguments_to_cpu,
    cpu_backend.cuda_device_arguments_to_cpu_in_backward,
)

GPU = (
    multi_tensor.foreach_multi_tensor_fallbacks,
    multi_tensor.grad_clip_without_host_sync,
)

MEGATRON_FSDP = (
    megatron_fsdp.dp_tp_mesh_from_groups,
    megatron_fsdp.skip_dtensor_world_check,
    megatron_fsdp.fsdp_tied_embedding_grad,
)

SAFE_LOADING = (
    safe_loading.restrict_dcp_metadata_unpickling,
    safe_loading.load_dcp_objects_weights_only,
)

ONNX_RUNTIME = (
    onnx_runtime.alias_moved_torch_onnx_modules,
    onnx_runtime.torchscript_exporter_by_default,
    onnx_runtime.stand_in_for_torch_interop_utils,
)

APPLIED: list = []  # names of the global patches applied in this process, in order


def _apply(patches) -> None:
    check_versions()
    for fn in patches:
        if fn.__name__ not in APPLIED:
            fn()
            APPLIED.append(fn.__name__)


def apply_cpu_backend() -> None:
    """Run megatron-core on the CPU: apply the CPU_BACKEND patches (once per process). Call before building
    megatron-core objects, and only where torch.cuda is unavailable."""
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_backend() is for machines without a GPU; this one has CUDA")
    if cpu_backend_enabled():
        return
    _apply(CPU_BACKEND)
    if int(os.environ.get("RANK", "0")) == 0:  # the same on every rank: said once
        logger.warning("no GPU found: running megatron-core on the CPU with gloo (megatron_patch.compat.cpu_backend)")


def cpu_backend_enabled() -> bool:
    return all(fn.__name__ in APPLIED for fn in CPU_BACKEND)


def apply_gpu_fixes() -> None:
    """Training on a GPU without apex/Transformer Engine: apply the GPU patches (once per process)."""
    _apply(GPU)


def apply_megatron_fsdp_fixes() -> None:
    """Megatron-FSDP (ZeRO-2) with pipeline parallelism: apply the MEGATRON_FSDP patches (once per process)."""
    _apply(MEGATRON_FSDP)


def apply_safe_loading() -> None:
    """Checkpoints load without running code they contain: apply the SAFE_LOADING patches (once per process)."""
    _apply(SAFE_LOADING)


def apply_onnx_runtime_fixes() -> None:
    """ONNX Runtime training 1.19.2 on torch 2.11: apply the ONNX_RUNTIME patches (once per process), before
    ORTModule is imported."""
    _apply(ONNX_RUNTIME)
