"""The BERT conversion table (megatron_patch/conversion/tables/bert.py) and `tools/convert_checkpoint.py` on BERT.

Fast: the table uses every tensor transformers saves for BertForPreTraining, BertForMaskedLM and a bare
BertModel (heads it lacks are the optional parts to initialise); the real MiniLM-L6 files go through the
table and back bit for bit; unsupported config.json settings are refused in words; config.json is
rebuilt from the engine's configuration.
Slow (the CLI, several processes each): MiniLM HF -> engine (TP2xPP2) -> HF with --verify both ways, every
original tensor bit for bit, the initialised heads reported, the export usable by transformers; a tiny
random BertForPreTraining the same at TP1xPP2, heads included; swapped Q/K blocks fail --verify.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from megatron_patch.config import Config
from megatron_patch.conversion import tables
from megatron_patch.conversion.mapping import ConversionError, absent_parts, check_coverage, dims, options, to_hf, to_mcore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conversion_utils import assert_same_tensors, explain, read_safetensors_dir, run_convert  # noqa: E402
from test_bert_model import save_tiny_bert  # noqa: E402

BERT = tables.for_model_type("bert")
SMALL = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
             max_position_embeddings=64)


def _rules(config: dict, **overrides):
    cfg = Config(**{**BERT.engine_args(config), **overrides})
    return cfg, BERT.table.expand(options(cfg), cfg.num_layers)


def _saved_names(model) -> list:
    """The tensor names save_pretrained writes (tied copies left out), with a bare model's `bert.` prefix restored
    as the reader restores it."""
    import tempfile

    from megatron_patch.conversion.load_hf import hf_reader

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return hf_reader(d, BERT)[0]


@pytest.mark.parametrize("cls,absent", [
    ("BertForPreTraining", set()),
    ("BertForMaskedLM", {"pooler", "NSP head"}),
    ("BertModel", {"MLM head", "NSP head"}),
])
def test_table_uses_every_tensor_transformers_saves(cls, absent):
    import transformers

    config = transformers.BertConfig(**SMALL)
    names = _saved_names(getattr(transformers, cls)(config))
    cfg, rules = _rules(config.to_dict())
    missing = absent_parts(rules, names)
    assert set(missing) == absent
    check_coverage(BERT.table, [r for r in rules if r.part not in missing], names, where=cls)


def test_minilm_goes_through_the_table_and_back_bit_for_bit(minilm_dir):
    from megatron_patch.conversion.hf_io import read_hf_config
    from megatron_patch.conversion.load_hf import hf_reader

    cfg, rules = _rules(read_hf_config(minilm_dir))
    assert (cfg.model_family, cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.norm_epsilon) == \
        ("bert", 6, 384, 1536, 1e-12)
    names, read = hf_reader(minilm_dir, BERT)
    assert "bert.embeddings.position_ids" in names and BERT.table.ignored("bert.embeddings.position_ids")
    missing = absent_parts(rules, names)
    assert set(missing) == {"MLM head", "NSP head"}  # MiniLM keeps its pooler
    present = [r for r in rules if r.part not in missing]
    check_coverage(BERT.table, present, names, where=minilm_dir)
    d = dims(cfg, 30522, 30528)
    mcore = {r.mcore: to_mcore(r, read, d) for r in present}
    assert mcore["embedding.word_embeddings.weight"].shape == (30528, 384)
    assert not mcore["embedding.word_embeddings.weight"][30522:].any()
    back = dict(to_hf(present, mcore.__getitem__, d))
    original = {n: read(n) for n in names if not BERT.table.ignored(n)}
    assert_same_tensors(original, back, "MiniLM through the bert table")


def test_a_model_without_binary_head_drops_pooler_and_nsp_tensors():
    import transformers

    cfg, rules = _rules(transformers.BertConfig(**SMALL).to_dict(), bert_binary_head=False)
    assert not any(r.mcore.startswith(("pooler.", "binary_head.")) for r in rules)
    unbuilt = {h for r in BERT.table.unbuilt(options(cfg), cfg.num_layers) for h in r.hf}
    assert unbuilt == {"bert.pooler.dense.weight", "bert.pooler.dense.bias", "cls.seq_relationship.weight",
                       "cls.seq_relationship.bias"}
    assert tables.bert.architectures(cfg) == ["BertForMaskedLM"]


@pytest.mark.parametrize("change,phrase", [
    (dict(hidden_act="gelu_new"), "hidden_act 'gelu_new'"),
    (dict(hidden_act="relu"), "hidden_act 'relu'"),
    (dict(position_embedding_type="relative_key"), "position_embedding_type 'relative_key'"),
    (dict(type_vocab_size=3), "type_vocab_size 3"),
    (dict(is_decoder=True), "is_decoder"),
], ids=["gelu_new", "relu", "relative_key", "type_vocab_3", "decoder"])
def test_unsupported_config_is_refused_in_words(change, phrase):
    import transformers

    config = {**transformers.BertConfig(**SMALL).to_dict(), **change}
    with pytest.raises(ConversionError, match="not supported") as e:
        BERT.engine_args(config)
    assert phrase in str(e.value) and "absolute position embeddings" in str(e.value)


def test_config_json_from_the_engine_configuration(minilm_dir):
    import transformers

    from megatron_patch.conversion.hf_io import read_hf_config

    original = read_hf_config(minilm_dir)
    cfg = Config(**BERT.engine_args(original))
    rebuilt = transformers.BertConfig.from_dict(BERT.hf_config(cfg, 30522, None))
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "hidden_act", "initializer_range",
                "hidden_dropout_prob", "attention_probs_dropout_prob", "tie_word_embeddings"):
        assert getattr(rebuilt, key) == original.get(key, getattr(rebuilt, key)), key
    assert rebuilt.architectures == ["BertForPreTraining"]
    assert BERT.export_config(original, cfg)["architectures"] == ["BertForPreTraining"]


# ------------------------------------------------------------------------------------------ the CLI (slow)

def _convert(*args: str, plant=None):
    proc = run_convert(*args, plant=plant, timeout=900)
    return proc


def _layout(tp: int, pp: int):
    return ["--target-tensor-model-parallel-size", str(tp), "--target-pipeline-model-parallel-size", str(pp)]


def _hidden_states(model_dir: str, text: str) -> torch.Tensor:
    from transformers import AutoTokenizer, BertModel

    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = tok([text, "a shorter one"], padding=True, return_tensors="pt")
    with torch.no_grad():
        return BertModel.from_pretrained(model_dir).eval()(**batch).last_hidden_state


@pytest.mark.slow  # four conversions' worth of processes (hf2mcore 4 + verify 4, mcore2hf + verify 1)
def test_minilm_round_trip_tp2pp2_is_exact_and_reports_the_heads(minilm_dir, tmp_path):
    ck, out = str(tmp_path / "ck"), str(tmp_path / "hf")
    proc = _convert("--direction", "hf2mcore", "--load-dir", minilm_dir, "--save-dir", ck, *_layout(2, 2), "--verify")
    assert proc.returncode == 0 and "verify passed" in proc.stdout, explain(proc)
    assert "has no MLM head: initialised 5 tensor(s)" in proc.stdout and "has no NSP head" in proc.stdout, explain(proc)
    assert "hidden states" in proc.stdout and "pooler output" in proc.stdout
    proc = _convert("--direction", "mcore2hf", "--load-dir", ck, "--save-dir", out, "--verify")
    assert proc.returncode == 0 and "verify passed" in proc.stdout and "MLM logits" in proc.stdout, explain(proc)
    original = {f"bert.{n}": t for n, t in read_safetensors_dir(minilm_dir).items() if n != "embeddings.position_ids"}
    exported = read_safetensors_dir(out)
    heads = {n for n in exported if n.startswith("cls.")}
    assert heads == {"cls.predictions.bias", "cls.predictions.transform.dense.weight",
                     "cls.predictions.transform.dense.bias", "cls.predictions.transform.LayerNorm.weight",
                     "cls.predictions.transform.LayerNorm.bias", "cls.seq_relationship.weight", "cls.seq_relationship.bias"}
    assert_same_tensors(original, {n: t for n, t in exported.items() if n not in heads}, "MiniLM round trip")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["BertForPreTraining"]
    text = "Megatron converts the sentence encoder both ways."
    torch.testing.assert_close(_hidden_states(out, text), _hidden_states(minilm_dir, text), rtol=0, atol=0)


@pytest.mark.slow
def test_tiny_pretraining_model_round_trip_with_heads(tmp_path):
    src, ck, out = save_tiny_bert(str(tmp_path / "tiny")), str(tmp_path / "ck"), str(tmp_path / "hf")
    proc = _convert("--direction", "hf2mcore", "--load-dir", src, "--save-dir", ck, *_layout(1, 2),
                    "--make-vocab-size-divisible-by", "8", "--verify")
    assert proc.returncode == 0 and "verify passed" in proc.stdout, explain(proc)
    assert "MLM logits" in proc.stdout and "NSP logits" in proc.stdout and "initialised" not in proc.stdout
    proc = _convert("--direction", "mcore2hf", "--load-dir", ck, "--save-dir", out, "--verify")
    assert proc.returncode == 0 and "verify passed" in proc.stdout, explain(proc)
    assert_same_tensors(read_safetensors_dir(src), read_safetensors_dir(out), "tiny BertForPreTraining round trip")


@pytest.mark.slow
def test_swapped_query_and_key_fail_verify(tmp_path):
    src = save_tiny_bert(str(tmp_path / "tiny"))
    proc = _convert("--direction", "hf2mcore", "--load-dir", src, "--save-dir", str(tmp_path / "ck"), *_layout(2, 1),
                    "--verify", plant="swap_qk")
    assert proc.returncode == 3 and "verify FAILED" in proc.stdout, explain(proc)
