"""GPT-2 and Llama-style families (RoPE, SwiGLU, RMSNorm, GQA, untied) as megatron-core GPTModel."""
from __future__ import annotations

import inspect
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core import parallel_state as mpu
from megatron.core.inference.utils import InferenceMode
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_patch.config.memory_model import padded_vocab
from megatron_patch.config.config import Config  # the class, not the package (its parser reaches conversion)
from megatron_patch.config.rule import resolved_attention_backend, transformer_engine_available

from .linear_cross_entropy import linear_cross_entropy
from .norm import HeadNorm, LatentNorm, SequenceParallelNorm
from .sdpa_attention import MLASDPAttention, SDPAttention


def padded_vocab_size(vocab_size: int, cfg: Config) -> int:
    """Round the tokenizer's vocabulary up to a multiple of lcm(--make-vocab-size-divisible-by, TP).

    Megatron-LM multiplies the two, so its padded size changes with TP; the lcm keeps one padded size
    for every TP that divides the multiple, so checkpoints move between TP layouts unchanged.
    """
    return padded_vocab(cfg, vocab_size)  # one rule for the model and the planner's memory model


def resolve_attention_backend(cfg: Config) -> str:
    backend = resolved_attention_backend(cfg.attention_backend)
    if backend == "te" and not transformer_engine_available():
        raise RuntimeError("--attention-backend te needs Transformer Engine, which is not installed; use sdpa")
    return backend


def mla_config(cfg: Config) -> dict:
    """MLATransformerConfig fields of a multi-latent-attention model (none otherwise)."""
    if not cfg.multi_latent_attention:
        return {}
    return dict(multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                qk_head_dim=cfg.qk_head_dim, qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
                rope_type=cfg.rope_type, rotary_base=cfg.rotary_base, rotary_scaling_factor=cfg.rotary_scaling_factor,
                original_max_position_embeddings=cfg.original_max_position_embeddings, beta_fast=cfg.beta_fast,
                beta_slow=cfg.beta_slow, mscale=cfg.mscale, mscale_all_dim=cfg.mscale_all_dim)


def build_transformer_config(cfg: Config) -> TransformerConfig:
    dtype = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32
    on_gpu = torch.cuda.is_available()
    if cfg.multi_latent_attention:
        from megatron.core.transformer.transformer_config import MLATransformerConfig as config_class
    else:
        config_class = TransformerConfig
    return config_class(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size or 4 * cfg.hidden_size,
        normalization=cfg.normalization,
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=cfg.swiglu,
        activation_func=F.silu if cfg.swiglu else partial(F.gelu, approximate="tanh") if cfg.openai_gelu else F.gelu,
        kv_channels=cfg.kv_channels,
        qk_layernorm=cfg.qk_layernorm,
        add_bias_linear=not cfg.disable_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias or not cfg.disable_bias_linear,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
        sequence_parallel=cfg.sequence_parallel,
        bf16=cfg.bf16,
        fp16=cfg.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        autocast_dtype=dtype,
        recompute_granularity=cfg.recompute_granularity,
        recompute_method=cfg.recompute_method if cfg.recompute_granularity == "full" else None,
        recompute_num_layers=cfg.recompute_num_layers if cfg.recompute_granularity == "full" else None,
        attention_softmax_in_fp32=True,
        calculate_per_token_loss=cfg.calculate_per_token_loss,
        # native/te: megatron-core's fused cross entropy of the logits; linear and triton are ours (GPTModelWithVocab)
        cross_entropy_loss_fusion=cfg.cross_entropy_loss_fusion and cfg.cross_entropy_fusion_impl in ("native", "te"),
        cross_entropy_fusion_impl="te" if cfg.cross_entropy_fusion_impl == "te" else "native",
        # Fusions that need apex/TE kernels or CUDA are off; torch.compile fuses instead.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not on_gpu,
        # gloo runs a batch of isend/irecv as independent messages; with PP=2 both directions share one
        # peer and interleaved 1F1B can pair them wrongly. Unbatched p2p orders them by rank parity.
        batch_p2p_comm=on_gpu,
        # --load-hf overwrites every parameter (its coverage check proves it): a random init first would only
        # cost time and, on the CPU, a transient fp32 copy of each weight (0.5 GiB for a 32k x 2048 output layer).
        perform_initialization=not cfg.load_hf,
        **moe_config(cfg),
        **mla_config(cfg),
        # Transformer Engine's layers run FP8 themselves; without it models/float8.py routes the linears (build.py)
        **(dict(fp8=cfg.fp8_format, fp8_recipe=cfg.fp8_recipe)
           if cfg.fp8_format and resolve_attention_backend(cfg) == "te" else {}),
    )


def moe_config(cfg: Config) -> dict:
    """TransformerConfig fields of megatron-core's MoELayer (none for a dense model)."""
    if not cfg.num_experts:
        return {}
    return dict(
        num_moe_experts=cfg.num_experts,
        moe_ffn_hidden_size=cfg.expert_ffn_size,
        moe_layer_freq=cfg.moe_layer_freq,
        moe_router_topk=cfg.moe_router_topk,
        moe_router_pre_softmax=cfg.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor,
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=cfg.moe_shared_expert_gate,
        moe_router_load_balancing_type=cfg.moe_router_load_balancing_type,
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        moe_z_loss_coeff=cfg.moe_z_loss_coeff,
        moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
        moe_expert_capacity_factor=cfg.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=cfg.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=cfg.moe_token_drop_policy,
        moe_per_layer_logging=cfg.moe_per_layer_logging,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.expert_tp_size,
        # Transformer Engine's fused permute/unpermute, router top-k and aux-loss kernels (CUDA only), and its
        # grouped GEMM: off; the local spec runs the experts as a SequentialMLP of Column/RowParallelLinear.
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )


def is_moe_layer(cfg: Config, layer: int) -> bool:
    """Whether global layer `layer` (from 0) has an MoELayer (megatron-core's moe_layer_freq rule)."""
    return layer in cfg.moe_layers()


def layer_spec(cfg: Config, moe: bool = False) -> ModuleSpec:
    backend = resolve_attention_backend(cfg)
    num_experts = cfg.num_experts if moe else None
    if backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=cfg.qk_layernorm)
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, normalization=cfg.normalization,
                                    qk_layernorm=cfg.qk_layernorm, multi_latent_attention=cfg.multi_latent_attention)
    attention = spec.submodules.self_attention.submodules
    if cfg.multi_latent_attention:  # megatron-core's local core attention cannot run MLA (MLASDPAttention)
        from megatron_patch.compat.mla import mla_query_projection_without_norm, mla_rotary_key_gradient_over_tp

        mla_query_projection_without_norm()
        mla_rotary_key_gradient_over_tp()
        attention.core_attention = MLASDPAttention
        if cfg.qk_layernorm:  # the query latent's norm only where there is a query latent (megatron-core's rule)
            attention.kv_layernorm = LatentNorm
            attention.q_layernorm = LatentNorm if cfg.q_lora_rank is not None else IdentityOp
    else:
        if backend == "sdpa":
            attention.core_attention = SDPAttention
        if cfg.qk_layernorm:  # megatron-core's local torch norm refuses sequence parallelism, which q/k norms never see
            attention.q_layernorm = attention.k_layernorm = HeadNorm
    spec.submodules.input_layernorm = SequenceParallelNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelNorm
    return spec


class GPTModelWithVocab(GPTModel):
    """megatron-core's GPTModel whose loss ignores the padding of the vocabulary.

    The embedding and output layer have `padded_vocab_size` rows (a multiple of what TP needs), but only the
    first `vocab_size` are tokens. Megatron-LM lets the padding rows into the softmax, so its loss depends
    on the padded size; here their logits are -inf before the cross entropy, so the loss is the model's
    over its real vocabulary: it equals Hugging Face's for a converted model, whatever the TP size."""

    def __init__(self, *args, true_vocab_size: int, fused_linear_cross_entropy: bool = False,
                 triton_cross_entropy: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.true_vocab_size = true_vocab_size
        self.fused_linear_cross_entropy = fused_linear_cross_entropy
        self.triton_cross_entropy = triton_cross_entropy
        if fused_linear_cross_entropy and "output_processor" not in inspect.signature(GPTModel.forward).parameters:
            raise RuntimeError("--cross-entropy-fusion-impl linear hooks into GPTModel.forward(output_processor=...) of "
                               "megatron-core 0.19; this megatron-core has no such argument: use native")

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, *args, **kwargs):
        """megatron-core's forward; with `fused_linear_cross_entropy` and labels (training, evaluation), the last stage's
        loss comes from the fused output layer + cross entropy instead of logits. Without labels (generation,
        conversion --verify) the logits come as usual."""
        if (self.fused_linear_cross_entropy and labels is not None and self.post_process
                and kwargs.get("output_processor") is None and not InferenceMode.is_active()):
            kwargs["output_processor"] = self._fused_loss
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels, *args, **kwargs)

    def _fused_loss(self, *, hidden_states, output_layer, output_weight, labels, **_):
        """GPTModel._postprocess's output processor: the per-token loss [b, s] the unfused path would give
        (output_layer -> padded rows masked -> vocab-parallel cross entropy), without its logits."""
        if output_layer.bias is not None or getattr(self.config, "use_mup", False):
            raise RuntimeError("--cross-entropy-fusion-impl linear: the output layer has a bias or MuP scaling, "
                               "which the fused loss does not apply")
        weight = output_weight if output_weight is not None else output_layer.weight
        return linear_cross_entropy(hidden_states, weight, labels, self.true_vocab_size, tp_group=output_layer.tp_group,
                                    sequence_parallel=output_layer.sequence_parallel)

    def compute_language_model_loss(self, labels, logits):
        if self.triton_cross_entropy:  # the padding is a column bound inside its kernels: no masking pass
            from .triton_cross_entropy import triton_vocab_parallel_cross_entropy

            return triton_vocab_parallel_cross_entropy(logits, labels, self.true_vocab_size, tp_group=self.tp_group)
        return super().compute_language_model_loss(labels, mask_vocab_padding(logits, self.true_vocab_size))


def mask_vocab_padding(logits: torch.Tensor, true_vocab_size: int) -> torch.Tensor:
    """`logits` (this TP rank's slice of the padded vocabulary, last dimension) with the padding rows' logits
    set to -inf in place, so the cross entropy runs over the real vocabulary only."""
    local = logits.size(-1)
    first = mpu.get_tensor_model_parallel_rank() * local
    cut = min(max(true_vocab_size - first, 0), local)
    if cut < local:
        logits[..., cut:] = float("-inf")  # not saved for backward by the output layer: safe in place
    return logits


def build_gpt_model(cfg: Config, vocab_size: int, pre_process: bool = True, post_process: bool = True,
                    vp_stage: Optional[int] = None) -> GPTModel:
    """One pipeline stage (or virtual stage `vp_stage`) of the model, on this rank's device."""
    config = build_transformer_config(cfg)
    if cfg.num_experts and not cfg.disable_bias_linear:
        from megatron_patch.compat.moe import one_rank_reductions_are_identity

        one_rank_reductions_are_identity()  # experts add their bias in place to linear_fc2's output
    spec = layer_spec(cfg)
    if cfg.num_experts and resolve_attention_backend(cfg) == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization=cfg.normalization,
                                          vp_stage=vp_stage)
    elif cfg.num_experts:  # MoE and dense layers by --moe-layer-freq: one spec per layer of this stage
        first = get_transformer_layer_offset(config, vp_stage=vp_stage)
        specs = [layer_spec(cfg, moe=is_moe_layer(cfg, first + i))
                 for i in range(get_num_layers_to_build(config, vp_stage=vp_stage))]
        spec = TransformerBlockSubmodules(layer_specs=specs, layer_norm=SequenceParallelNorm)
    elif resolve_attention_backend(cfg) != "te":  # our norms for the final layer norm too
        spec = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                          layer_norm=SequenceParallelNorm)
    model = GPTModelWithVocab(
        config=config,
        true_vocab_size=vocab_size,
        fused_linear_cross_entropy=cfg.cross_entropy_loss_fusion and cfg.cross_entropy_fusion_impl == "linear",
        triton_cross_entropy=cfg.cross_entropy_loss_fusion and cfg.cross_entropy_fusion_impl == "triton",
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(vocab_size, cfg),
        max_sequence_length=cfg.max_position_embeddings or cfg.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type,
        rotary_base=cfg.rotary_base,
        rope_scaling=cfg.use_rope_scaling,
        rope_scaling_factor=cfg.rope_scaling_factor,
        vp_stage=vp_stage,
    )
    if cfg.sft and cfg.pack_sequences:
        from megatron_patch.compat.rope import packed_rope_in_one_pass

        packed_rope_in_one_pass()
    if cfg.use_rope_scaling:
        from megatron_patch.compat.rope import llama3_rope_scaling

        llama3_rope_scaling(model.rotary_pos_emb, base=cfg.rotary_base, factor=cfg.rope_scaling_factor,
                            low_freq_factor=cfg.rope_scaling_low_freq_factor,
                            high_freq_factor=cfg.rope_scaling_high_freq_factor,
                            original_max_position_embeddings=cfg.rope_scaling_original_max_position_embeddings)
    if cfg.num_experts and not cfg.disable_bias_linear and cfg.sequence_parallel:
        from megatron_patch.compat.moe import expert_biases_not_sequence_parallel

        expert_biases_not_sequence_parallel([model])  # reduced over expert data parallelism only
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
