"""Each --tokenizer-type gives the ids of the matching Hugging Face fast tokenizer on real text."""
import os
import shutil

import pytest

from megatron_patch.data.tokenizers import build_tokenizer
from megatron_patch.data.tokenizers.python_bpe import PythonBPE

EXTRA = ["Café naïve résumé — 東京 “quotes” 3.14159 <html> \t tabs\n\nnew paragraph", "  leading spaces", ""]


def test_gpt2_matches_hf_and_python_reference(gpt2_files, texts, tmp_path):
    from transformers import GPT2TokenizerFast

    vocab, merges = gpt2_files
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    # transformers 5 returns no ids when given the files as arguments; a directory load works.
    shutil.copy(vocab, tmp_path / "vocab.json")
    shutil.copy(merges, tmp_path / "merges.txt")
    hf = GPT2TokenizerFast.from_pretrained(str(tmp_path))
    ref = PythonBPE(vocab, merges)
    sample = texts[:400] + EXTRA
    for t in sample:
        ids = ours.tokenize(t)
        assert ids == hf(t, add_special_tokens=False)["input_ids"], t[:80]
        assert ids == ref.encode(t), t[:80]
        assert ours.detokenize(ids) == t
    assert ours.tokenize_batch(sample) == [ours.tokenize(t) for t in sample]
    assert ours.eod == hf.convert_tokens_to_ids("<|endoftext|>")
    assert ours.vocab_size == len(hf)


@pytest.mark.parametrize("kind,lower", [("BertWordPieceLowerCase", True), ("BertWordPieceCase", False)])
def test_bert_matches_hf(kind, lower, minilm_vocab, texts, tmp_path):
    from transformers import BertTokenizerFast

    ours = build_tokenizer(kind, vocab_file=minilm_vocab)
    shutil.copy(minilm_vocab, tmp_path / "vocab.txt")
    hf = BertTokenizerFast.from_pretrained(str(tmp_path), do_lower_case=lower)
    sample = texts[:300] + EXTRA
    got = ours.tokenize_batch(sample)
    assert got == [hf(t, add_special_tokens=False)["input_ids"] for t in sample]
    assert (ours.cls, ours.sep, ours.mask, ours.pad) == (hf.cls_token_id, hf.sep_token_id, hf.mask_token_id, hf.pad_token_id)
    assert ours.vocab_size == len(hf) == 30522
    if lower:
        assert ours.tokenize("HELLO World") == ours.tokenize("hello world")
    else:
        assert ours.tokenize("HELLO") != ours.tokenize("hello")


def test_sentencepiece_matches_hf(spm_model, texts, tmp_path):
    from transformers import LlamaTokenizerFast

    ours = build_tokenizer("SentencePieceTokenizer", tokenizer_model=spm_model)
    shutil.copy(spm_model, tmp_path / "tokenizer.model")
    hf = LlamaTokenizerFast.from_pretrained(str(tmp_path), legacy=False)
    # HF's converted BPE merges a run of whitespace at the very start of a text differently from
    # sentencepiece itself (the reference we run); such texts are compared after that run.
    sample = [t.lstrip() for t in texts[:300]] + EXTRA[:1]
    got = ours.tokenize_batch(sample)
    # split_special_tokens: literal "<s>" in text is text, as in sentencepiece and Megatron.
    assert got == [hf(t, add_special_tokens=False, split_special_tokens=True)["input_ids"] for t in sample]
    assert ours.eod == hf.eos_token_id
    assert ours.detokenize(got[0]) == sample[0]


def test_huggingface_directory_tokenizer(minilm_dir, minilm_vocab, texts):
    from tokenizers import Tokenizer

    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=minilm_dir)
    rust = Tokenizer.from_file(os.path.join(minilm_dir, "tokenizer.json"))
    rust.no_truncation()  # MiniLM ships with truncation at 128 tokens and padding on
    rust.no_padding()
    sample = texts[:200]
    assert ours.tokenize_batch(sample) == [rust.encode(t, add_special_tokens=False).ids for t in sample]
    # The real MiniLM tokenizer.json and its vocab.txt through our WordPiece path agree too.
    wp = build_tokenizer("BertWordPieceLowerCase", vocab_file=minilm_vocab)
    assert wp.tokenize_batch(sample) == ours.tokenize_batch(sample)
    assert ours.cls == wp.cls and ours.mask == wp.mask


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.tokenize("1 2 99") == [1, 2, 99]
    assert tok.vocab_size == 101 and tok.eod == 100
    assert tok.detokenize([3, 4]) == "3 4"
    with pytest.raises(ValueError, match="vocab-size"):
        tok.tokenize("100")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tokenizer_type="GPT2BPETokenizer"), "--vocab-file"),
        (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/nope.json", merge_file="/nope.txt"), "no such file"),
        (dict(tokenizer_type="SentencePieceTokenizer"), "--tokenizer-model"),
        (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/nope"), "local directory"),
        (dict(tokenizer_type="NullTokenizer"), "--vocab-size"),
        (dict(tokenizer_type="WordLevel"), "choose one of"),
    ],
)
def test_bad_tokenizer_arguments(kwargs, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        build_tokenizer(**kwargs)
