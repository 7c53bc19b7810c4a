"""BERT pretraining samples for Hugging Face (`megatron_patch.templates.pretraining_data`): megatron-core's
masked-LM + next-sentence samples re-expressed as `BertForPreTraining` arguments, checked against the raw
megatron-core samples, against the tokenized corpus itself, and against a real `BertForPreTraining` loss."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import run_tool
from megatron_patch.data.indexed_dataset import IndexedDataset
from megatron_patch.data.tokenizers import build_tokenizer
from megatron_patch.templates import globals as run_globals
from megatron_patch.templates.pretraining_data import (
    build_train_valid_test_datasets_for_huggingface as build_hf,
    get_tokenizer,
)

SEQ = 64
KEYS = {"input_ids", "attention_mask", "token_type_ids", "labels", "next_sentence_label"}


@pytest.fixture(scope="module")
def bert_prefix(minilm_vocab, tmp_path_factory):
    """A small demo corpus (real English docstrings; smaller than conftest's `corpus`, to stay fast),
    sentence-split and tokenized with the real MiniLM WordPiece vocabulary, as a user does."""
    from megatron_patch.demo.corpus import build_demo_corpus

    workdir = tmp_path_factory.mktemp("hfbert")
    corpus = str(workdir / "corpus.jsonl")
    assert build_demo_corpus(corpus, max_bytes=200_000)[0] > 300
    prefix = str(workdir / "hfbert")
    run_tool("preprocess_data.py", "--input", corpus, "--output-prefix", prefix, "--tokenizer-type",
             "BertWordPieceLowerCase", "--vocab-file", minilm_vocab, "--split-sentences")
    return prefix + "_text_sentence"


@pytest.fixture(scope="module")
def tok(minilm_vocab):
    return build_tokenizer("BertWordPieceLowerCase", vocab_file=minilm_vocab)


@pytest.fixture(scope="module")
def train(bert_prefix, tok, tmp_path_factory):
    args = argparse.Namespace(data_cache_path=str(tmp_path_factory.mktemp("cache")))
    saved, run_globals._ARGS = run_globals._ARGS, args
    try:
        return build_hf([bert_prefix], "mmap", "969,30,1", (400, 10, 10), SEQ, 0.15, 0.1, 1234, True,
                        tokenizer=tok)[0]
    finally:
        run_globals._ARGS = saved


@pytest.fixture(scope="module")
def stream(bert_prefix) -> str:
    """Every sentence's token ids, in corpus order, as one space-separated string (for contiguity checks)."""
    ds = IndexedDataset(bert_prefix)
    return " " + " ".join(map(str, np.concatenate([ds[i] for i in range(len(ds))]).tolist())) + " "


def _in(stream: str, ids) -> bool:
    return " " + " ".join(map(str, ids)) + " " in stream


@pytest.fixture
def args(monkeypatch):
    """Install a flags namespace as the run's get_args() for one test."""
    def install(**flags):
        monkeypatch.setattr(run_globals, "_ARGS", argparse.Namespace(**flags))

    return install


def test_sample_format(train):
    assert len(train) >= 400
    s = train[0]
    assert set(s) == KEYS
    for k in KEYS - {"next_sentence_label"}:
        assert isinstance(s[k], torch.Tensor) and s[k].dtype == torch.int64 and s[k].shape == (SEQ,), k
    assert s["next_sentence_label"].dtype == torch.int64 and s["next_sentence_label"].shape == ()
    batch = torch.utils.data.default_collate([train[i] for i in range(4)])
    assert batch["input_ids"].shape == (4, SEQ) and batch["next_sentence_label"].shape == (4,)


def test_fields_match_megatron_sample_and_corpus(train, tok, stream):
    checked = untruncated = 0
    for i in range(200):
        s, raw = train[i], train.dataset[i]
        ids, labels = s["input_ids"].numpy(), s["labels"].numpy()
        seps = np.nonzero(ids == tok.sep)[0]
        assert ids[0] == tok.cls and len(seps) == 2
        n = int(seps[-1]) + 1  # real tokens end with the second [SEP]; padding follows
        assert (ids[n:] == tok.pad).all()
        assert s["attention_mask"].sum() == n and (s["attention_mask"][:n] == 1).all()
        types = s["token_type_ids"].numpy()
        assert (types[:seps[0] + 1] == 0).all() and (types[seps[0] + 1:n] == 1).all() and (types[n:] == 0).all()
        masked = raw["loss_mask"] == 1  # may be all 0: a short sample can get no masked tokens
        assert (labels[~masked] == -100).all()
        assert (labels[masked] == raw["labels"][masked]).all() and (labels[masked] >= 0).all()
        assert (ids == raw["text"]).all()
        checked += int(masked.sum())
        # Undo the masking with our labels: segments A and B must then be real text of the corpus, and in
        # corpus order exactly when next_sentence_label is 0 (HF: B continues A).
        original = np.where(labels != -100, labels, ids)
        a, b = original[1:seps[0]].tolist(), original[seps[0] + 1:seps[1]].tolist()
        assert _in(stream, a) and _in(stream, b), f"sample {i}: segments are not corpus text"
        if not raw["truncated"]:  # trimming can cut A's end or B's start; untrimmed pairs are exact
            untruncated += 1
            # (not "and A+B is absent" for label 1: the docstrings repeat phrases, so both orders can occur)
            if s["next_sentence_label"] == 0:
                assert _in(stream, a + b), f"sample {i}: label 0 but B does not follow A"
            else:
                assert _in(stream, b + a), f"sample {i}: label 1 but A does not follow B"
    assert checked > 200 and untruncated > 20


def test_next_sentence_label_is_megatron_is_random(train):
    nsp = np.array([int(train[i]["next_sentence_label"]) for i in range(200)])
    raw = np.array([train.dataset[i]["is_random"] for i in range(200)])
    assert set(nsp.tolist()) == {0, 1} and 0.35 < nsp.mean() < 0.65
    assert (nsp == raw).all()


def test_bert_for_pretraining_loss(train, tok):
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    config = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=SEQ, type_vocab_size=2)
    model = BertForPreTraining(config).eval()
    batch = torch.utils.data.default_collate([train[i] for i in range(8)])
    with torch.no_grad():
        out = model(**batch)
    assert torch.isfinite(out.loss)
    labels = batch["labels"]
    kept = labels != -100
    assert kept.sum() == sum(int(train.dataset[i]["loss_mask"].sum()) for i in range(8))
    mlm = F.cross_entropy(out.prediction_logits[kept], labels[kept])
    nsp = F.cross_entropy(out.seq_relationship_logits, batch["next_sentence_label"])
    torch.testing.assert_close(out.loss, mlm + nsp)


def test_empty_splits_are_none(bert_prefix, tok, tmp_path, args):
    args(data_cache_path=str(tmp_path))
    for counts in [(50, 5, 0), (50, 5, 5)]:
        tr, va, te = build_hf(bert_prefix, "mmap", "980,20", counts, SEQ, 0.15, 0.1, 1234, False, tokenizer=tok)
        assert te is None and len(tr) >= 50 and len(va) >= 5
        assert set(va[0]) == KEYS
    # A split with weight but no samples asked for is None too, not a dataset of length 0.
    tr, va, te = build_hf([bert_prefix], "cached", "90,5,5", (50, 0, 5), SEQ, 0.15, 0.1, 1234, True, tokenizer=tok)
    assert va is None and len(te) >= 5


def test_without_binary_head(bert_prefix, tok, tmp_path, args):
    args(data_cache_path=str(tmp_path))
    tr = build_hf([bert_prefix], "mmap", "969,30,1", (50, 5, 5), SEQ, 0.15, 0.1, 1234, True, binary_head=False,
                  tokenizer=tok)[0]
    s = tr[0]
    assert set(s) == KEYS - {"next_sentence_label"}  # fits BertForMaskedLM
    assert (s["token_type_ids"] == 0).all() and (s["input_ids"] == tok.sep).sum() == 1


def test_get_tokenizer_from_flags(minilm_vocab, bert_prefix, tmp_path, args):
    args(tokenizer_type="BertWordPieceLowerCase", vocab_file=minilm_vocab, merge_file=None,
         data_cache_path=str(tmp_path))
    t = get_tokenizer()
    assert t is get_tokenizer()  # built once
    assert t.vocab_size == 30522 and t.eod == t.sep and t.cls == 101 and t.mask == 103 and t.pad == 0
    assert t.inv_vocab[t.mask] == "[MASK]"
    # tokenizer=None: the datasets use the flags' tokenizer
    tr = build_hf([bert_prefix], "mmap", "980,20", (20, 5, 0), SEQ, 0.15, 0.1, 1234, True)[0]
    assert tr[0]["input_ids"][0] == t.cls


def test_get_tokenizer_gpt2(tmp_path, args):
    # A four-token GPT-2 vocabulary written here: conftest's trained one costs seconds to build.
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps({"h": 0, "i": 1, "hi": 2, "<|endoftext|>": 3}))
    merges.write_text("#version: 0.2\nh i\n")
    args(tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    t = get_tokenizer()
    assert t.vocab_size == 4 and t.eod == 3 and t.tokenize("hi") == [2]


def test_get_tokenizer_errors(minilm_vocab, args):
    args(tokenizer_type=None, vocab_file=None, merge_file=None)
    with pytest.raises(ValueError, match="--tokenizer-type"):
        get_tokenizer()
    args(tokenizer_type="BertWordPieceCase", vocab_file=None, merge_file=None)
    with pytest.raises(ValueError, match="--vocab-file"):
        get_tokenizer()
    args(tokenizer_type="GPT2BPETokenizer", vocab_file=None, merge_file=None)
    with pytest.raises(ValueError, match="--merge-file"):
        get_tokenizer()
    args(task="pretraining")  # flags from some other parser: no tokenizer flags at all
    with pytest.raises(ValueError, match="no --tokenizer-type, --vocab-file, --merge-file flag"):
        get_tokenizer()
