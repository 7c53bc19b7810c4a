"""megatron-core's optimizer (mixed-precision wrapper, ZeRO-1 distributed optimizer, clipping, loss
scaling) with `--optimizers apex_adam|apex_lamb`, and its learning-rate schedule."""
from __future__ import annotations

from typing import Tuple

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_patch.compat.optimizer import replace_torch_optimizer, use_fused_adam
from megatron_patch.config import Config
from megatron_patch.config.resume import scheduler_settings

from megatron_patch.accelerations.lamb import Lamb


def _apex_lamb():
    try:
        from apex.optimizers import FusedLAMB

        return FusedLAMB
    except ImportError:
        return None


def build_optimizer(cfg: Config, model_chunks) -> Tuple[object, str]:
    """(megatron optimizer, a sentence saying which implementation runs)."""
    import megatron.core.optimizer as mco

    opt_cfg = OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, clip_grad=cfg.clip_grad,
        bf16=cfg.bf16, fp16=cfg.fp16, params_dtype=torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32,
        loss_scale=cfg.loss_scale, initial_loss_scale=cfg.initial_loss_scale, min_loss_scale=cfg.min_loss_scale,
        loss_scale_window=cfg.loss_scale_window, hysteresis=cfg.hysteresis,
        use_distributed_optimizer=cfg.zero_1_memory_optimization or cfg.zero_2_memory_optimization,
        # --cpu-offload: the sharded fp32 main weights and Adam moments live in host memory and the Adam
        # step runs there (megatron-core's HybridDeviceOptimizer); the GPU keeps bf16 weights and grads.
        optimizer_cpu_offload=cfg.cpu_offload, optimizer_offload_fraction=1.0 if cfg.cpu_offload else 0.0,
        use_precision_aware_optimizer=cfg.cpu_offload,
    )
    opt = get_megatron_optimizer(opt_cfg, model_chunks)
    using_torch = getattr(mco, "USING_PYTORCH_OPTIMIZER", True)
    on_gpu = torch.cuda.is_available()
    if cfg.optimizers == "apex_lamb":
        fused = _apex_lamb()
        kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        replace_torch_optimizer(opt, lambda groups: (fused or Lamb)(groups, **kwargs))
        return opt, "apex FusedLAMB" if fused else "LAMB (torch foreach; apex not installed)"
    if cfg.cpu_offload:
        return opt, "Adam offloaded to the CPU (megatron-core HybridDeviceOptimizer)"
    if cfg.optimizer_step_fusion:
        from .fused_adam import apply_optimizer_step_fusion

        if on_gpu:
            use_fused_adam(opt)  # torch's own steps stay interchangeable: state kept as for its fused kernel
        return opt, apply_optimizer_step_fusion(opt, cfg.exp_avg_dtype, cfg.exp_avg_sq_dtype)
    if not using_torch:
        return opt, "fused Adam from Transformer Engine/apex"
    if on_gpu:
        use_fused_adam(opt)
        return opt, "torch AdamW (fused CUDA kernel; apex not installed)"
    return opt, "torch AdamW (foreach; no GPU, apex not installed)"


def build_scheduler(cfg: Config, optimizer) -> OptimizerParamScheduler:
    """Megatron's schedule, counted in samples: warmup, then constant/linear/cosine decay to --min-lr.

    On resume (Checkpointer.load) the checkpoint's step count is restored, and its settings (max/min lr, warmup,
    decay, weight decay) unless --override-opt-param-scheduler keeps this run's. Without either scheduler flag a
    schedule that differs from the checkpoint's was refused before launch (config.resume.check_schedule), so the
    two agree and taking the checkpoint's values changes nothing."""
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, **scheduler_settings(cfg),
        use_checkpoint_opt_param_scheduler=not cfg.override_opt_param_scheduler,
        override_opt_param_scheduler=cfg.override_opt_param_scheduler,
    )
