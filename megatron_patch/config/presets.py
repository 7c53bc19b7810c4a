"""Model families (`--model-family`) and sizes (`--model-size`). Explicit flags override a preset."""
from __future__ import annotations

from typing import Dict

# Architecture of each family: what makes a Llama a Llama.
FAMILIES: Dict[str, Dict[str, object]] = {
    "gpt": dict(position_embedding_type="learned_absolute", swiglu=False, normalization="LayerNorm",
                untie_embeddings_and_output_weights=False, disable_bias_linear=False),
    "llama": dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm",
                  untie_embeddings_and_output_weights=True, disable_bias_linear=True, norm_epsilon=1e-5,
                  hidden_dropout=0.0, attention_dropout=0.0),
    "qwen2": dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm", rotary_base=1000000,
                  untie_embeddings_and_output_weights=True, disable_bias_linear=True, add_qkv_bias=True, norm_epsilon=1e-6,
                  hidden_dropout=0.0, attention_dropout=0.0),
    # Llama 3.1-3.3 (LlamaForCausalLM with rope_type llama3): GQA, RoPE base 500000 scaled by 8 beyond the original
    # 8k context, 128k positions; the 3.2 1B/3B sizes tie their embeddings and scale by 32 (SIZE_EXTRAS)
    "llama3": dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm", rotary_base=500000,
                   use_rope_scaling=True, rope_scaling_factor=8.0, rope_scaling_low_freq_factor=1.0,
                   rope_scaling_high_freq_factor=4.0, rope_scaling_original_max_position_embeddings=8192,
                   max_position_embeddings=131072, untie_embeddings_and_output_weights=True, disable_bias_linear=True,
                   norm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0),
    # Qwen3 (Qwen3ForCausalLM): RMSNorm over each query and key head, no QKV bias, head dimension 128 whatever the
    # width; the sizes up to 4B tie their embeddings (SIZE_EXTRAS)
    "qwen3": dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm", rotary_base=1000000,
                  qk_layernorm=True, kv_channels=128, untie_embeddings_and_output_weights=True,
                  disable_bias_linear=True, norm_epsilon=1e-6, hidden_dropout=0.0, attention_dropout=0.0),
    "mistral": dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm",
                    untie_embeddings_and_output_weights=True, disable_bias_linear=True, norm_epsilon=1e-5,
                    hidden_dropout=0.0, attention_dropout=0.0),
    # Hugging Face BERT: post-LayerNorm, exact GELU, tied output layer, 512 positions, eps 1e-12.
    "bert": dict(position_embedding_type="learned_absolute", swiglu=False, normalization="LayerNorm",
                 untie_embeddings_and_output_weights=False, disable_bias_linear=False, norm_epsilon=1e-12,
                 max_position_embeddings=512),
    # Mixtral (MixtralForCausalLM): Mistral's attention, every MLP a sparse block of SwiGLU experts. Its router
    # takes softmax over all experts, keeps the top k and renormalises them to sum to 1; megatron-core's
    # router without --moe-router-pre-softmax takes top-k of the logits, then softmax over those k: the
    # same weights (softmax is monotonic, and exp(l_i)/sum_k exp(l_k) is p_i/sum_k p_k).
    "mixtral": dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm", rotary_base=1000000,
                    untie_embeddings_and_output_weights=True, disable_bias_linear=True, norm_epsilon=1e-5,
                    hidden_dropout=0.0, attention_dropout=0.0, moe_router_pre_softmax=False, moe_layer_freq=1,
                    moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.02),
    # Qwen2-MoE (Qwen2MoeForCausalLM; Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (QKV biases), routed
    # experts of --moe-ffn-hidden-size plus one shared expert behind a sigmoid gate. norm_topk_prob is
    # False in those checkpoints: the top-k softmax probabilities are used as they are, which is
    # megatron-core's --moe-router-pre-softmax (softmax over all experts, then top-k, no renormalisation).
    "qwen2_moe": dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm", rotary_base=1000000,
                      untie_embeddings_and_output_weights=True, disable_bias_linear=True, add_qkv_bias=True,
                      norm_epsilon=1e-6, hidden_dropout=0.0, attention_dropout=0.0, moe_router_pre_softmax=True,
                      moe_layer_freq=1, moe_shared_expert_gate=True, moe_router_load_balancing_type="aux_loss",
                      moe_aux_loss_coeff=0.001),
    # Qwen3-MoE (Qwen3MoeForCausalLM; 30B-A3B, 235B-A22B): Qwen3's attention, every MLP 128 experts top 8, no shared
    # expert; the released models renormalise the top-k weights (norm_topk_prob true): megatron-core's default router
    "qwen3_moe": dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm", rotary_base=1000000,
                      qk_layernorm=True, kv_channels=128, untie_embeddings_and_output_weights=True,
                      disable_bias_linear=True, norm_epsilon=1e-6, hidden_dropout=0.0, attention_dropout=0.0,
                      moe_router_pre_softmax=False, moe_layer_freq=1, moe_router_load_balancing_type="aux_loss",
                      moe_aux_loss_coeff=0.001),
    # DeepSeek-V2 (DeepseekV2ForCausalLM; the Lite shape): multi-latent attention (queries from the hidden state,
    # a 512-rank key/value latent, 128 + 64 RoPE query/key channels, 128 value channels, YaRN x40 over 4k), the first
    # layer dense, then 64 routed experts top 6 (softmax, no renormalisation) and 2 shared experts
    "deepseek_v2": dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm", rotary_base=10000,
                        multi_latent_attention=True, qk_layernorm=True, kv_lora_rank=512, qk_head_dim=128,
                        qk_pos_emb_head_dim=64, v_head_dim=128, rope_type="yarn", rotary_scaling_factor=40.0,
                        original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=0.707,
                        mscale_all_dim=0.707, max_position_embeddings=163840, untie_embeddings_and_output_weights=True,
                        disable_bias_linear=True, norm_epsilon=1e-6, hidden_dropout=0.0, attention_dropout=0.0,
                        moe_router_pre_softmax=True, moe_router_topk_scaling_factor=1.0,
                        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.001),
}

# (num_layers, hidden_size, num_attention_heads, num_query_groups or None, ffn_hidden_size or None)
SIZES: Dict[str, Dict[str, tuple]] = {
    "gpt": {"tiny": (2, 128, 4, None, None), "125m": (12, 768, 12, None, None), "350m": (24, 1024, 16, None, None),
            "760m": (24, 1536, 16, None, None), "1.3b": (24, 2048, 16, None, None), "2.7b": (32, 2560, 32, None, None)},
    "llama": {"tiny": (2, 128, 4, 2, 352), "1.3b": (24, 2048, 16, None, 5504), "7b": (32, 4096, 32, None, 11008),
              "13b": (40, 5120, 40, None, 13824), "8b": (32, 4096, 32, 8, 14336)},
    "llama3": {"tiny": (2, 128, 4, 2, 352), "1b": (16, 2048, 32, 8, 8192), "3b": (28, 3072, 24, 8, 8192),
               "8b": (32, 4096, 32, 8, 14336), "70b": (80, 8192, 64, 8, 28672), "405b": (126, 16384, 128, 8, 53248)},
    # Qwen2.5 (and Qwen2: the same shapes at 0.5B, 1.5B, 7B, 72B)
    "qwen2": {"tiny": (2, 128, 4, 2, 352), "0.5b": (24, 896, 14, 2, 4864), "1.5b": (28, 1536, 12, 2, 8960),
              "3b": (36, 2048, 16, 2, 11008), "7b": (28, 3584, 28, 4, 18944), "14b": (48, 5120, 40, 8, 13824),
              "32b": (64, 5120, 40, 8, 27648), "72b": (80, 8192, 64, 8, 29568)},
    "qwen3": {"tiny": (2, 128, 4, 2, 352), "0.6b": (28, 1024, 16, 8, 3072), "1.7b": (28, 2048, 16, 8, 6144),
              "4b": (36, 2560, 32, 8, 9728), "8b": (36, 4096, 32, 8, 12288), "14b": (40, 5120, 40, 8, 17408),
              "32b": (64, 5120, 64, 8, 25600)},
    "mistral": {"tiny": (2, 128, 4, 2, 352), "7b": (32, 4096, 32, 8, 14336)},
    "bert": {"tiny": (2, 128, 4, None, None), "base": (12, 768, 12, None, None), "large": (24, 1024, 16, None, None)},
    # ffn: the experts' width (Mixtral has no dense MLP)
    "mixtral": {"tiny": (2, 128, 4, 2, 352), "8x7b": (32, 4096, 32, 8, 14336), "8x22b": (56, 6144, 48, 8, 16384)},
    # ffn: the dense MLP's width (layers without experts; Qwen2-MoE's intermediate_size)
    "qwen2_moe": {"tiny": (2, 128, 4, 2, 352), "a2.7b": (24, 2048, 16, None, 5632), "57b-a14b": (28, 3584, 28, 4, 18944)},
    "qwen3_moe": {"tiny": (2, 128, 4, 2, 352), "30b-a3b": (48, 2048, 32, 4, 6144), "235b-a22b": (94, 4096, 64, 4, 12288)},
    # ffn: the dense layers' width
    "deepseek_v2": {"tiny": (2, 128, 4, None, 352), "lite": (27, 2048, 16, None, 10944)},
}

# What a size changes beyond its shape: tied embeddings of the small sizes, Llama 3.2's scaling, a tiny model's
# head dimension (the family's real one, 128, would make a tiny model's attention 4 x 128 wide)
SIZE_EXTRAS: Dict[str, Dict[str, Dict[str, object]]] = {
    "llama3": {"1b": dict(untie_embeddings_and_output_weights=False, rope_scaling_factor=32.0),
               "3b": dict(untie_embeddings_and_output_weights=False, rope_scaling_factor=32.0)},
    "qwen2": {s: dict(untie_embeddings_and_output_weights=False) for s in ("0.5b", "1.5b", "3b")},
    "qwen3": {"tiny": dict(kv_channels=48), **{s: dict(untie_embeddings_and_output_weights=False)
                                                for s in ("0.6b", "1.7b", "4b")}},
    "qwen3_moe": {"tiny": dict(kv_channels=48)},
    "deepseek_v2": {"tiny": dict(moe_layer_freq=[0, 1], kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
                                 v_head_dim=24, original_max_position_embeddings=64, rotary_scaling_factor=4.0,
                                 max_position_embeddings=1024),
                    "lite": dict(moe_layer_freq=[0] + [1] * 26)},
}

# Experts of the MoE sizes: (experts, top-k, expert width or None for ffn, shared expert width or None)
MOE_SIZES: Dict[str, Dict[str, tuple]] = {
    "mixtral": {"tiny": (4, 2, None, None), "8x7b": (8, 2, None, None), "8x22b": (8, 2, None, None)},
    # Qwen1.5-MoE-A2.7B: 60 experts of 1408, top 4, shared 5632; Qwen2-57B-A14B: 64 of 2560, top 8, shared 20480
    "qwen2_moe": {"tiny": (4, 2, 96, 192), "a2.7b": (60, 4, 1408, 5632), "57b-a14b": (64, 8, 2560, 20480)},
    # Qwen3-30B-A3B: 128 experts of 768, top 8; Qwen3-235B-A22B: 128 of 1536, top 8
    "qwen3_moe": {"tiny": (8, 2, 96, None), "30b-a3b": (128, 8, 768, None), "235b-a22b": (128, 8, 1536, None)},
    # DeepSeek-V2-Lite: 64 experts of 1408, top 6, 2 shared experts (2 x 1408)
    "deepseek_v2": {"tiny": (8, 2, 48, 96), "lite": (64, 6, 1408, 2816)},
}


def preset(family: str, size: str) -> Dict[str, object]:
    """Flag values of a family/size preset, or ValueError naming the choices."""
    if family not in FAMILIES:
        raise ValueError(f"--model-family {family!r}: choose one of {', '.join(FAMILIES)}")
    values = dict(FAMILIES[family])
    if size is not None:
        if size not in SIZES[family]:
            raise ValueError(f"--model-size {size!r} for {family}: choose one of {', '.join(SIZES[family])}")
        layers, hidden, heads, groups, ffn = SIZES[family][size]
        values.update(num_layers=layers, hidden_size=hidden, num_attention_heads=heads)
        if groups:
            values["num_query_groups"] = groups
        if ffn:
            values["ffn_hidden_size"] = ffn
        if size in MOE_SIZES.get(family, {}):
            experts, topk, expert_ffn, shared = MOE_SIZES[family][size]
            values.update(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=expert_ffn or ffn)
            if shared:
                values["moe_shared_expert_intermediate_size"] = shared
        values.update(SIZE_EXTRAS.get(family, {}).get(size, {}))
    elif family in MOE_SIZES:  # the family's experts without a size: the tiny one's, so that it builds
        experts, topk, expert_ffn, shared = MOE_SIZES[family]["tiny"]
        values.update(num_experts=experts, moe_router_topk=topk)
        if shared or expert_ffn:
            values["moe_ffn_hidden_size"] = expert_ffn
        if shared:
            values["moe_shared_expert_intermediate_size"] = shared
    return values
