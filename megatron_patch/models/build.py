"""Model building for the engine: this rank's bare model chunks (GPTModel, or BertModel for --model-family bert; one
per virtual pipeline stage), initialised, with the model switches applied (grouped experts, gradient-accumulation
fusion, --compile), and their wrappers for training (Float16Module; megatron-core DDP, whose distributed optimizer
is ZeRO-1, or Megatron-FSDP for ZeRO-2). Weights from elsewhere (--load-hf) are loaded by the caller's
`load_weights` (a WeightLoader), after initialisation and before the switches: the entry point builds it from the
conversion (conversion.hf_source.HFWeights) and hands it to the training loop."""
from __future__ import annotations

from typing import Dict, List, Optional, Protocol

import torch
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import Float16Module

from megatron_patch.config import Config, ConfigError
from megatron_patch.parallel import current_device, print_rank_0

from .bert import build_bert_model
from .compile import apply_compile
from .gpt import build_gpt_model, padded_vocab_size, resolve_attention_backend
from .grouped_experts import apply_grouped_experts
from .init import layout_invariant_init
from .wgrad_fusion import apply_gradient_accumulation_fusion


class WeightLoader(Protocol):
    """Weights from outside the engine loaded into this rank's bare model chunks (--load-hf:
    megatron_patch.conversion.hf_source.HFWeights, which the entry point builds)."""

    hf_config: Optional[Dict]  # the Hugging Face config.json the weights come from: the checkpoint's manifest keeps it

    def __call__(self, chunks: List[torch.nn.Module], cfg: Config) -> None:
        """Fill `chunks` (unwrapped, initialised) for the validated `cfg`. Collective."""


def model_vocab_size(cfg: Config, tokenizer) -> int:
    """Rows of the embedding before padding: --load-hf's config.json vocab_size, else the tokenizer's."""
    if cfg.model_vocab_size is None:
        return tokenizer.vocab_size
    if tokenizer.vocab_size > cfg.model_vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {cfg.model_vocab_size} "
                          f"(vocab_size of --load-hf's config.json or of the checkpoint): use the model's tokenizer")
    return cfg.model_vocab_size


def model_info(cfg: Config, vocab: int, hf_config: Optional[Dict] = None) -> Dict:
    """What a checkpoint records about the model besides its configuration (conversion reads it): the vocabulary
    before and after padding, and the Hugging Face config.json the model was loaded from (--load-hf), if any."""
    info = {"vocab_size": vocab, "padded_vocab_size": padded_vocab_size(vocab, cfg)}
    if hf_config is not None:
        info["hf_config"] = hf_config
    return info


def build_model_chunk(cfg: Config, vocab_size: int, pre_process: bool, post_process: bool, vp_stage=None):
    """One bare model chunk of the family: BERT (--model-family bert) or GPT (every other family)."""
    if cfg.model_family == "bert":
        return build_bert_model(cfg, vocab_size, pre_process, post_process, vp_stage, add_binary_head=cfg.bert_binary_head)
    return build_gpt_model(cfg, vocab_size, pre_process, post_process, vp_stage)


def build_model_chunks(cfg: Config, vocab_size: int,
                       load_weights: Optional[WeightLoader] = None) -> List[torch.nn.Module]:
    """This rank's bare model chunks (GPTModel, or BertModel for --model-family bert; one per virtual pipeline
    stage), initialised (or loaded by `load_weights`, e.g. from --load-hf) and, with --compile, compiled."""
    if cfg.load_hf and load_weights is None:  # else the model would train from random weights, silently
        raise ValueError(f"load_hf={cfg.load_hf!r} needs the loader of its weights: pass "
                         f"load_weights=megatron_patch.conversion.hf_source.HFWeights(cfg.load_hf) (the entry points "
                         f"do; conversion.hf_source.build_model builds a model with it)")
    vpp = cfg.virtual_pipeline_model_parallel_size
    chunks = []
    for vp in range(vpp or 1):
        stage = vp if vpp else None
        chunk = build_model_chunk(
            cfg, vocab_size,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            vp_stage=stage,
        )
        if cfg.init_layout_invariant and not cfg.load_hf:
            layout_invariant_init(chunk, cfg.seed, cfg.init_method_std, cfg.swiglu)
        chunks.append(chunk)
    if cfg.num_experts and not cfg.zero_2_memory_optimization:
        # the experts' gradients and optimizer state apart at every EP (EP 1 too): checkpoints move between EPs
        from megatron_patch.compat.moe import expert_params_apart

        expert_params_apart(chunks)
    if load_weights is not None:  # before the wrappers: fp16/bf16 copies, DDP buffers and FSDP shards start from these
        load_weights(chunks, cfg)
    if cfg.lora_rank:  # after the base weights, before the wrappers: DDP then gives the frozen base no gradient buffer
        from .lora import apply_lora

        print_rank_0(apply_lora(chunks, cfg))
    if cfg.moe_grouped_gemm:
        from .moe_dispatch import apply_device_dispatch

        print_rank_0(apply_grouped_experts(chunks))
        print_rank_0(apply_device_dispatch(chunks))
    if cfg.fp8_format and resolve_attention_backend(cfg) != "te":  # with Transformer Engine, its layers do FP8
        from .float8 import apply_float8

        print_rank_0(apply_float8(chunks, cfg.fp8_recipe, cfg.fp8_layers, cfg.gradient_accumulation_fusion))
    if cfg.gradient_accumulation_fusion:
        print_rank_0(apply_gradient_accumulation_fusion(chunks))
    if cfg.compile:
        print_rank_0(apply_compile(chunks, cfg.compile_mode))
    return chunks


def build_model(cfg: Config, vocab_size: int, for_training: bool = True,
                load_weights: Optional[WeightLoader] = None) -> List[torch.nn.Module]:
    """This rank's model chunks (loaded by `load_weights`, if given), wrapped for mixed precision and megatron-core
    DDP; with `for_training=False` the bare chunks (no gradient buffers: checkpoint conversion)."""
    chunks = build_model_chunks(cfg, vocab_size, load_weights)
    return wrap_model(cfg, chunks) if for_training else chunks


def wrap_model(cfg: Config, chunks: List[torch.nn.Module]) -> List[torch.nn.Module]:
    """Model chunks wrapped for mixed precision (Float16Module) and megatron-core DDP (ZeRO-1: its
    distributed optimizer) or Megatron-FSDP (ZeRO-2)."""
    tconfig = chunks[0].config
    if cfg.bf16 or cfg.fp16:
        chunks = [Float16Module(tconfig, c) for c in chunks]
    if cfg.zero_2_memory_optimization:
        return [_wrap_megatron_fsdp(cfg, tconfig, c) for c in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not cfg.grad_reduce_in_bf16, overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.zero_1_memory_optimization,
        check_for_nan_in_grad=False, bucket_size=None,
    )
    return [DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)]


# Megatron-FSDP communicates in units of about this many elements; without an explicit size it keeps
# full-size gradient buckets alive, which would undo ZeRO-2's saving.
FSDP_UNIT_ELEMENTS = 40_000_000


def _wrap_megatron_fsdp(cfg: Config, tconfig, chunk):
    """ZeRO-2: megatron-core's Megatron-FSDP with gradients and optimizer state sharded over DP."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    from megatron_patch.compat import apply_megatron_fsdp_fixes

    apply_megatron_fsdp_fixes()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads", overlap_grad_reduce=True, overlap_param_gather=False,
        check_for_nan_in_grad=False, bucket_size=FSDP_UNIT_ELEMENTS, suggested_communication_unit_size=FSDP_UNIT_ELEMENTS,
        megatron_fsdp_main_grads_dtype=torch.float32,
        gradient_reduce_div_fusion=torch.cuda.is_available(),  # gloo has no PREMUL_SUM
    )
    return FullyShardedDataParallel(config=tconfig, ddp_config=ddp_config, module=chunk, device=current_device())


