"""Today's families (issue 29): Llama 3.x, Qwen2.5, Qwen3, Qwen3-MoE, DeepSeek-V2 (multi-latent attention), from
Hugging Face to the engine and back.

1. Real config.json files (their public fields written by hand: no download) are accepted, in the form their
   release wrote them (transformers 4.x: rope_theta beside rope_scaling) and in the form this transformers
   writes (5.x: rope_parameters), and each is the engine's preset of that size.
2. An engine model's config.json (the export) gives back the same engine model.
3. Every field of a config.json that changes the model and that the engine cannot build is refused in words.
4. Llama 3.x's RoPE scaling: the engine's frequencies are transformers' for any low/high frequency factors and
   original context (megatron-core hard-codes 1, 4 and 8192: compat.rope.llama3_rope_scaling); the canary says
   when megatron-core no longer needs the patch.
5. The CLI, one representative layout per family (the family x layout matrix is in test_conversion_families and
   test_conversion_moe, slow): hf2mcore --verify against transformers, mcore2hf back bit for bit, and (dense) the
   export generates what the original generates. The default lane runs 2 workers each: llama3 at PP2, qwen3_moe at
   TP2 (its 2 query groups and q/k norms over the ranks, the experts sliced over ETP 2) and deepseek_v2 at TP2 x EP2
   x ETP1 (multi-latent attention over TP 2, whole experts split over EP 2: the routed-expert rules are Qwen-MoE's).
   Slow (CI time): qwen3 at PP2 (the q/k norm rules are qwen3_moe's), llama3 at TP2, and the 4-worker TP2 x EP2
   (ETP 2) layouts of qwen3_moe and deepseek_v2.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conversion_utils import (  # noqa: E402
    FAMILIES, assert_same_tensors, explain, generate, manifest, read_safetensors_dir, run_convert, save_hf_model,
)

from megatron_patch.config import Config, parse_args  # noqa: E402
from megatron_patch.config.model_source import ARCHITECTURE  # noqa: E402
from megatron_patch.conversion import tables  # noqa: E402
from megatron_patch.conversion.mapping import ConversionError  # noqa: E402

_LLAMA31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
            "rope_type": "llama3"}
_COMMON = {"attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02, "torch_dtype": "bfloat16",
           "use_cache": True}
# The public fields of the released config.json files, as their releases wrote them
REAL = {
    "Llama-3.1-8B": dict(_COMMON, architectures=["LlamaForCausalLM"], attention_bias=False, bos_token_id=128000,
                         eos_token_id=128001, hidden_size=4096, intermediate_size=14336, max_position_embeddings=131072,
                         mlp_bias=False, model_type="llama", num_attention_heads=32, num_hidden_layers=32,
                         num_key_value_heads=8, pretraining_tp=1, rms_norm_eps=1e-05, rope_scaling=_LLAMA31,
                         rope_theta=500000.0, tie_word_embeddings=False, vocab_size=128256),
    "Llama-3.2-1B": dict(_COMMON, architectures=["LlamaForCausalLM"], attention_bias=False, bos_token_id=128000,
                         eos_token_id=128001, head_dim=64, hidden_size=2048, intermediate_size=8192,
                         max_position_embeddings=131072, mlp_bias=False, model_type="llama", num_attention_heads=32,
                         num_hidden_layers=16, num_key_value_heads=8, pretraining_tp=1, rms_norm_eps=1e-05,
                         rope_scaling=dict(_LLAMA31, factor=32.0), rope_theta=500000.0, tie_word_embeddings=True,
                         vocab_size=128256),
    "Qwen2.5-0.5B": dict(_COMMON, architectures=["Qwen2ForCausalLM"], bos_token_id=151643, eos_token_id=151643,
                         hidden_size=896, intermediate_size=4864, max_position_embeddings=32768, max_window_layers=24,
                         model_type="qwen2", num_attention_heads=14, num_hidden_layers=24, num_key_value_heads=2,
                         rms_norm_eps=1e-06, rope_theta=1000000.0, sliding_window=32768, tie_word_embeddings=True,
                         use_sliding_window=False, vocab_size=151936),
    "Qwen2.5-7B": dict(_COMMON, architectures=["Qwen2ForCausalLM"], bos_token_id=151643, eos_token_id=151643,
                       hidden_size=3584, intermediate_size=18944, max_position_embeddings=131072, max_window_layers=28,
                       model_type="qwen2", num_attention_heads=28, num_hidden_layers=28, num_key_value_heads=4,
                       rms_norm_eps=1e-06, rope_theta=1000000.0, sliding_window=131072, tie_word_embeddings=False,
                       use_sliding_window=False, vocab_size=152064),
    "Qwen3-0.6B": dict(_COMMON, architectures=["Qwen3ForCausalLM"], attention_bias=False, bos_token_id=151643,
                       eos_token_id=151645, head_dim=128, hidden_size=1024, intermediate_size=3072,
                       max_position_embeddings=40960, max_window_layers=28, model_type="qwen3", num_attention_heads=16,
                       num_hidden_layers=28, num_key_value_heads=8, rms_norm_eps=1e-06, rope_scaling=None,
                       rope_theta=1000000, sliding_window=None, tie_word_embeddings=True, use_sliding_window=False,
                       vocab_size=151936),
}
REAL.update({
    "Qwen3-8B": dict(REAL["Qwen3-0.6B"], hidden_size=4096, intermediate_size=12288, max_window_layers=36,
                     num_attention_heads=32, num_hidden_layers=36, tie_word_embeddings=False),
    "Qwen3-30B-A3B": dict(_COMMON, architectures=["Qwen3MoeForCausalLM"], attention_bias=False, bos_token_id=151643,
                          decoder_sparse_step=1, eos_token_id=151645, head_dim=128, hidden_size=2048,
                          intermediate_size=6144, max_position_embeddings=40960, max_window_layers=48, mlp_only_layers=[],
                          model_type="qwen3_moe", moe_intermediate_size=768, norm_topk_prob=True,
                          num_attention_heads=32, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
                          num_key_value_heads=4, output_router_logits=False, rms_norm_eps=1e-06, rope_scaling=None,
                          rope_theta=1000000.0, router_aux_loss_coef=0.001, sliding_window=None,
                          tie_word_embeddings=False, use_sliding_window=False, vocab_size=151936),
    "DeepSeek-V2-Lite": dict(_COMMON, architectures=["DeepseekV2ForCausalLM"], attention_bias=False,
                             aux_loss_alpha=0.001, bos_token_id=100000, eos_token_id=100001, first_k_dense_replace=1,
                             hidden_size=2048, intermediate_size=10944, kv_lora_rank=512, max_position_embeddings=163840,
                             model_type="deepseek_v2", moe_intermediate_size=1408, moe_layer_freq=1, n_group=1,
                             n_routed_experts=64, n_shared_experts=2, norm_topk_prob=False, num_attention_heads=16,
                             num_experts_per_tok=6, num_hidden_layers=27, num_key_value_heads=16, pretraining_tp=1,
                             q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, rms_norm_eps=1e-06,
                             rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                           "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                           "type": "yarn"},
                             rope_theta=10000, routed_scaling_factor=1.0, scoring_func="softmax", seq_aux=True,
                             tie_word_embeddings=False, topk_group=1, topk_method="greedy", v_head_dim=128,
                             vocab_size=102400),
})
PRESET = {"Llama-3.1-8B": ("llama3", "8b"), "Llama-3.2-1B": ("llama3", "1b"), "Qwen2.5-0.5B": ("qwen2", "0.5b"),
          "Qwen2.5-7B": ("qwen2", "7b"), "Qwen3-0.6B": ("qwen3", "0.6b"), "Qwen3-8B": ("qwen3", "8b"),
          "Qwen3-30B-A3B": ("qwen3_moe", "30b-a3b"), "DeepSeek-V2-Lite": ("deepseek_v2", "lite")}
# The fields of a model that a preset fixes (the vocabulary comes from the tokenizer, positions from the run)
SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "head_dim",
         "untie_embeddings_and_output_weights", "rotary_base", "use_rope_scaling", "rope_scaling_factor",
         "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
         "rope_scaling_original_max_position_embeddings", "qk_layernorm", "add_qkv_bias", "norm_epsilon", "swiglu",
         "normalization", "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax",
         "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_topk_scaling_factor",
         "moe_layer_freq", "model_family", "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
         "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_scaling_factor", "original_max_position_embeddings",
         "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


MLA = SHAPE[SHAPE.index("q_lora_rank"):]


def _shape(cfg: Config) -> dict:
    out = {k: getattr(cfg, k) for k in SHAPE if k != "head_dim"}
    out["head_dim"] = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    if not cfg.use_rope_scaling:  # the scaling's parameters mean nothing without it
        out = {k: v for k, v in out.items() if not k.startswith("rope_scaling_")}
    if not cfg.multi_latent_attention:  # nor MLA's without it
        out = {k: v for k, v in out.items() if k not in MLA}
    if cfg.moe_router_topk_scaling_factor in (None, 1.0):
        out["moe_router_topk_scaling_factor"] = None  # x 1 is no scaling
    return out


def _engine_args(config_json: dict) -> dict:
    return tables.for_model_type(config_json["model_type"]).engine_args(config_json)


# ------------------------------------------------------------------------------------- real config.json

@pytest.mark.parametrize("name", list(REAL))
def test_a_real_config_json_is_accepted_and_is_its_preset(name):
    """The release's config.json, and the same after transformers has read and rewritten it (5.x nests RoPE in
    rope_parameters), give one engine model, which is the preset of its family and size."""
    from transformers import AutoConfig

    args = _engine_args(REAL[name])
    rewritten = AutoConfig.for_model(**REAL[name]).to_dict()
    assert "rope_theta" not in rewritten and "rope_parameters" in rewritten  # the 5.x form, really
    assert _engine_args(rewritten) == args
    family, size = PRESET[name]
    preset = parse_args(["--model-family", family, "--model-size", size, "--mock-data"]).validate(1)
    assert _shape(Config(**args)) == _shape(preset), name


@pytest.mark.parametrize("name", list(REAL))
def test_the_export_config_json_gives_the_same_model(name):
    """hf_config of the engine model (what mcore2hf writes), read by transformers and back: the same architecture."""
    from transformers import AutoConfig

    family = tables.for_model_type(REAL[name]["model_type"])
    args = family.engine_args(REAL[name])
    exported = family.hf_config(Config(**args), REAL[name]["vocab_size"], REAL[name]["eos_token_id"])
    assert exported["architectures"] == REAL[name]["architectures"] and exported["model_type"] == REAL[name]["model_type"]
    back = family.engine_args(AutoConfig.for_model(**exported).to_dict())
    assert {k: back.get(k) for k in ARCHITECTURE} == {k: args.get(k) for k in ARCHITECTURE}
    assert tables.for_engine(Config(**args)) is family


def test_llama3_scaling_reaches_the_engine_with_its_own_values():
    """Every one of the four llama3 RoPE parameters is read from config.json (none left at a default)."""
    rope = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
            "original_max_position_embeddings": 4096, "rope_theta": 250000.0}
    args = _engine_args(dict(REAL["Llama-3.1-8B"], rope_scaling=None, rope_theta=None, rope_parameters=rope))
    assert (args["model_family"], args["use_rope_scaling"], args["rotary_base"], args["rope_scaling_factor"],
            args["rope_scaling_low_freq_factor"], args["rope_scaling_high_freq_factor"],
            args["rope_scaling_original_max_position_embeddings"]) == ("llama3", True, 250000.0, 16.0, 2.0, 8.0, 4096)
    plain = _engine_args(dict(REAL["Llama-3.1-8B"], rope_scaling=None, max_position_embeddings=8192))  # Llama 3.0
    assert plain["model_family"] == "llama" and not plain["use_rope_scaling"] and plain["rotary_base"] == 500000.0


REFUSED = [  # (model, changes, what the message says)
    ("Llama-3.1-8B", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
    ("Llama-3.1-8B", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope type 'dynamic'"),
    ("Llama-3.1-8B", dict(rope_scaling={k: v for k, v in _LLAMA31.items() if k != "low_freq_factor"}),
     "lacks low_freq_factor"),
    ("Llama-3.1-8B", dict(rope_scaling=dict(_LLAMA31, attention_factor=2.0)), "attention_factor 2.0"),
    ("Llama-3.1-8B", dict(pretraining_tp=2), "pretraining_tp 2"),
    ("Llama-3.1-8B", dict(attention_bias=True), "attention_bias"),
    ("Llama-3.1-8B", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("Qwen3-8B", dict(rope_scaling=_LLAMA31), "rope type 'llama3'"),  # only a Llama scales RoPE so
    ("Qwen3-8B", dict(attention_bias=True), "attention_bias"),  # Qwen3's puts a bias on o_proj too
    ("Qwen3-8B", dict(use_sliding_window=True), "sliding-window"),
    ("Qwen3-8B", dict(layer_types=["full_attention"] * 35 + ["sliding_attention"]), "sliding-window"),
    ("Qwen3-30B-A3B", dict(shared_expert_intermediate_size=768), "Qwen3-MoE has no shared expert"),
    ("Qwen3-30B-A3B", dict(num_experts_per_tok=129), "num_experts_per_tok 129"),
    ("DeepSeek-V2-Lite", dict(topk_method="group_limited_greedy"), "topk_method 'group_limited_greedy'"),
    ("DeepSeek-V2-Lite", dict(scoring_func="sigmoid"), "scoring_func 'sigmoid'"),
    ("DeepSeek-V2-Lite", dict(rms_norm_eps=1e-5), "rms_norm_eps 1e-05"),  # its latent norms keep 1e-6
    ("DeepSeek-V2-Lite", dict(attention_bias=True), "attention_bias"),
    ("DeepSeek-V2-Lite", dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope type 'linear'"),
    ("DeepSeek-V2-Lite", dict(moe_layer_freq=2), "moe_layer_freq 2"),
]


@pytest.mark.parametrize("name,changes,message", REFUSED, ids=[f"{n}-{m}" for n, _, m in REFUSED])
def test_a_field_the_engine_cannot_build_is_refused_in_words(name, changes, message):
    with pytest.raises(ConversionError, match=message.replace("(", r"\(")):
        _engine_args(dict(REAL[name], **changes))


# ------------------------------------------------------------------------------------- Llama 3.x's RoPE

def _megatron_rotary(factor: float):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding(kv_channels=64, rotary_percent=1.0, rotary_base=500000, rope_scaling=True,
                           rope_scaling_factor=factor, use_cpu_initialization=True)


def _transformers_inv_freq(rope: dict) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=512, num_attention_heads=8, max_position_embeddings=131072,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **rope})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert attention_factor == 1.0
    return inv_freq


@pytest.mark.parametrize("rope", [
    dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),  # 3.1
    dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),  # 3.2 1B/3B
    dict(factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position_embeddings=2048),
], ids=["3.1", "3.2-small", "other-bounds"])
def test_llama3_rope_frequencies_are_transformers(rope):
    from megatron_patch.compat.rope import llama3_rope_scaling

    rotary = _megatron_rotary(rope["factor"])
    llama3_rope_scaling(rotary, base=500000, factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
                        high_freq_factor=rope["high_freq_factor"],
                        original_max_position_embeddings=rope["original_max_position_embeddings"])
    torch.testing.assert_close(rotary.inv_freq, _transformers_inv_freq(rope), rtol=1e-6, atol=0)


def test_canary_megatron_core_hard_codes_the_llama3_bounds():
    """megatron-core alone scales with 1, 4 and 8192: right for Meta's checkpoints, wrong for others. When this
    fails, megatron-core reads the bounds itself: drop compat.rope.llama3_rope_scaling."""
    official = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    other = dict(official, low_freq_factor=2.0, original_max_position_embeddings=2048)
    torch.testing.assert_close(_megatron_rotary(8.0).inv_freq, _transformers_inv_freq(official), rtol=1e-6, atol=0)
    assert not torch.allclose(_megatron_rotary(8.0).inv_freq, _transformers_inv_freq(other), rtol=1e-3)


# ------------------------------------------------------------------------------------------------- the CLI

# id -> (family, TP, PP, EP, ETP or None for TP's, slow). CI time: the default lane keeps every property at 2 workers
# (see 5. above); the slow ones add breadth
LAYOUTS = {
    "llama3": ("llama3", 1, 2, 1, None, False),  # PP2: the only default-lane conversion over pipeline stages
    "llama3_tp2": ("llama3", 2, 1, 1, None, True),  # the 2 query groups over TP 2: qwen3_moe's (GQA, TP2) in the default lane
    "qwen3": ("qwen3", 1, 2, 1, None, True),  # the q/k norms (llama table): qwen3_moe's in the default lane
    "qwen3_moe": ("qwen3_moe", 2, 1, 1, None, False),  # 2 query groups, q/k norms and the experts (ETP 2) over TP 2
    "qwen3_moe_tp2_ep2": ("qwen3_moe", 2, 1, 2, None, True),  # 4 workers
    "deepseek_v2": ("deepseek_v2", 2, 1, 2, 1, False),  # MLA over TP 2, 2 whole experts per EP rank
    "deepseek_v2_tp2_ep2_etp2": ("deepseek_v2", 2, 1, 2, None, True),  # 4 workers
}


@pytest.mark.parametrize("family,tp,pp,ep,etp", [pytest.param(*c[:5], id=i, marks=pytest.mark.slow if c[5] else ())
                                                  for i, c in LAYOUTS.items()])
def test_each_family_converts_verifies_and_comes_back_bit_for_bit(family, tp, pp, ep, etp, tmp_path):
    src = save_hf_model(family, str(tmp_path / "hf"))
    ck, out = str(tmp_path / "ck"), str(tmp_path / "exported")
    proc = run_convert("--direction", "hf2mcore", "--load-dir", src, "--save-dir", ck, "--verify",
                       "--target-tensor-model-parallel-size", str(tp), "--target-pipeline-model-parallel-size", str(pp),
                       "--target-expert-model-parallel-size", str(ep),
                       *(["--target-expert-tensor-parallel-size", str(etp)] if etp else []),
                       "--make-vocab-size-divisible-by", "1")
    assert proc.returncode == 0 and "verify passed" in proc.stdout, explain(proc)
    m = manifest(ck)
    assert (m["layout"]["tp"], m["layout"]["pp"], m["layout"].get("ep", 1)) == (tp, pp, ep)
    assert m["layout"].get("etp", tp) == (etp or tp)
    assert m["config"]["save"] == ck  # the directory it was published as, not the staging one
    assert sorted(os.listdir(tmp_path)) == ["ck", "hf"], "hf2mcore left its staging directory or wrote elsewhere"
    proc = run_convert("--direction", "mcore2hf", "--load-dir", ck, "--save-dir", out, "--no-verify")
    assert proc.returncode == 0, explain(proc)
    assert_same_tensors(read_safetensors_dir(src), read_safetensors_dir(out), f"{family}: {out}")
    if family in FAMILIES:  # dense: the export generates what the original generates (MoE: test_conversion_moe)
        assert torch.equal(generate(out), generate(src))
