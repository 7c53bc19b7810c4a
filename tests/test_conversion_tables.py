"""The conversion transforms are exact inverses, and the tables cover the models transformers builds."""
import pytest
import torch

from megatron_patch.conversion import tables
from megatron_patch.conversion.mapping import ConversionError, check_coverage
from megatron_patch.conversion.transforms import CONV1D_QKV, FUSE_GATE_UP, FUSE_QKV, PAD_VOCAB, TRANSPOSE, Dims

D = Dims(heads=6, groups=2, head_dim=4, vocab=10, padded_vocab=16)


def test_qkv_grouping_puts_each_groups_heads_together():
    q = torch.arange(6 * 4).float().view(24, 1)  # rows: head h occupies rows 4h..4h+3
    k, v = 100 + torch.arange(8).float().view(8, 1), 200 + torch.arange(8).float().view(8, 1)
    fused = FUSE_QKV.to_mcore([q, k, v], D).view(-1)
    # group 0: query heads 0-2 (rows 0-11), key head 0, value head 0; then group 1
    assert fused[:12].tolist() == list(range(12))
    assert fused[12:16].tolist() == [100, 101, 102, 103] and fused[16:20].tolist() == [200, 201, 202, 203]
    assert fused[20:32].tolist() == list(range(12, 24)) and fused[32:36].tolist() == [104, 105, 106, 107]


@pytest.mark.parametrize("transform,inputs", [
    (FUSE_QKV, [torch.randn(24, 5), torch.randn(8, 5), torch.randn(8, 5)]),
    (FUSE_QKV, [torch.randn(24), torch.randn(8), torch.randn(8)]),
    (FUSE_GATE_UP, [torch.randn(7, 5), torch.randn(7, 5)]),
    (TRANSPOSE, [torch.randn(5, 9)]),
    (PAD_VOCAB, [torch.randn(10, 5)]),
], ids=["qkv_weight", "qkv_bias", "gate_up", "conv1d", "pad_vocab"])
def test_transforms_round_trip_bit_for_bit(transform, inputs):
    back = transform.to_hf(transform.to_mcore(inputs, D), D)
    assert len(back) == len(inputs)
    for a, b in zip(inputs, back):
        assert torch.equal(a, b)


def test_gpt2_fused_qkv_is_conv1d_then_grouped():
    mha = Dims(heads=2, groups=2, head_dim=3, vocab=10, padded_vocab=16)
    c_attn = torch.randn(6, 18)  # Conv1D [hidden, 3*hidden]: columns [Q | K | V]
    fused = CONV1D_QKV.to_mcore([c_attn], mha)
    q, k, v = c_attn.t().chunk(3)
    assert torch.equal(fused[:9], torch.cat([q[:3], k[:3], v[:3]]))  # head 0: its q, k, v rows
    assert torch.equal(CONV1D_QKV.to_hf(fused, mha)[0], c_attn)


def test_padding_rows_are_zero_and_a_wrong_vocab_is_refused():
    padded = PAD_VOCAB.to_mcore([torch.randn(10, 3)], D)
    assert padded.shape == (16, 3) and not padded[10:].any()
    with pytest.raises(ValueError, match="vocab_size is 10"):
        PAD_VOCAB.to_mcore([torch.randn(11, 3)], D)


def _hf_model(model_type, **kw):
    import transformers

    cls = {"gpt2": ("GPT2Config", "GPT2LMHeadModel"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[model_type]
    config = getattr(transformers, cls[0])(**kw)
    return config, getattr(transformers, cls[1])(config)


SMALL = {"gpt2": dict(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=101),
         "llama": dict(num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=101, max_position_embeddings=64),
         "qwen2": dict(num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=101, max_position_embeddings=64, tie_word_embeddings=True),
         "mistral": dict(num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                         num_key_value_heads=1, vocab_size=101, max_position_embeddings=64),
         "qwen3": dict(num_hidden_layers=2, hidden_size=32, head_dim=16, intermediate_size=48, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)}


@pytest.mark.parametrize("model_type", list(SMALL))
def test_tables_use_every_tensor_transformers_saves(model_type):
    from megatron_patch.config import Config
    from megatron_patch.conversion.mapping import options

    config, model = _hf_model(model_type, **SMALL[model_type])
    family = tables.for_model_type(model_type)
    args = family.engine_args(config.to_dict())
    cfg = Config(**args)
    rules = family.table.expand(options(cfg), cfg.num_layers)
    saved = [k for k in model.state_dict() if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    check_coverage(family.table, rules, saved, where="model")
    with pytest.raises(ConversionError, match="does not use"):
        check_coverage(family.table, rules, saved + ["model.extra.weight"], where="model")
    with pytest.raises(ConversionError, match="lacks"):
        check_coverage(family.table, rules, saved[1:], where="model")


def test_unsupported_config_is_refused_in_words():
    config, _ = _hf_model("llama", **SMALL["llama"], rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ConversionError, match="rope type 'linear'"):
        tables.for_model_type("llama").engine_args(config.to_dict())
    with pytest.raises(ConversionError, match="model_type 't5'"):
        tables.for_model_type("t5")


def test_family_registry_names_the_known_families_and_refuses_a_second_one():
    """One registry, name -> Family: every model_type and --model-family value leads to one family, an unknown
    name is refused with the known ones listed, and a second family under a taken name is a bug. (< 1 s)"""
    import dataclasses

    from megatron_patch.conversion.family import Registry
    from megatron_patch.conversion.mapping import OPTIONS, When

    known = tables.FAMILIES.names()
    assert known == ("bert", "deepseek_v2", "gpt2", "llama", "mixtral", "qwen2_moe")
    with pytest.raises(ConversionError, match="unknown model family 't5': the conversion knows " + ", ".join(known)):
        tables.family("t5")
    for f in tables.FAMILIES:
        assert all(tables.for_model_type(t) is f for t in f.model_types)
        assert all(tables.FAMILIES.for_engine_family(n) is f for n in f.engine_families)
        assert all(r.when is None or (isinstance(r.when, When) and r.when in OPTIONS) for r in f.table.rules)
    registry = Registry()
    registry.register(tables.llama.FAMILY)
    with pytest.raises(ValueError, match="qwen2 already registered"):
        registry.register(dataclasses.replace(tables.qwen2_moe.FAMILY, model_types=("qwen2",)))
