"""Each --tokenizer-type gives the ids of the matching Hugging Face fast tokenizer on real text."""
import json
import os
import re
import shutil

import pytest

from conftest import run_tool
from megatron_patch.data.indexed_dataset import IndexedDataset
from megatron_patch.data.tokenizers import TokenizerError, build_tokenizer
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


# Characters that BERT's normaliser removes, turns into spaces or splits off, one text each: soft hyphen (Cf),
# zero-width space / joiners / BOM (Cf), BEL, NUL, ESC and other controls (Cc), U+FFFD, tabs, CR/LF, VT/FF,
# line and paragraph separators, accents precomposed and combining (lower case strips them, cased keeps them),
# CJK ideographs (each a word) beside kana and hangul (not split), a no-break and an ideographic space.
CONTROL_AND_FORMAT = [
    "co\u00adoperate soft\u00ad\u00adhyphen \u00ad", "zero\u200bwidth space", "word\u200d\u200c\ufeffjoin",
    "bell\x07ring", "nul\x00byte", "bad\ufffdchar", "\x1b[31mred\x1b[0m", "tab\there\nnew\r\nline\x0bvt\x0cff",
    "\u2028line\u2029para\x85nel", "Cafe\u0301 Ångström ÉCOLE naïve", "e\u0301\u0327 x\u034fy",
    "東京タワー 中文字符 한국어", "a\u00a0b\u3000c", "\u0600\u061carabic \U0001F600 emoji",
]


@pytest.mark.parametrize("kind,lower", [("BertWordPieceLowerCase", True), ("BertWordPieceCase", False)])
def test_bert_matches_hf_on_control_and_format_characters(kind, lower, minilm_vocab, tmp_path):
    """Google's BERT normalisation (transformers' Python BertTokenizer) and BertTokenizerFast on the real MiniLM
    vocabulary: control and format characters dropped (clean_text), accents stripped only when lower-casing,
    CJK split. Under 2 s."""
    from transformers import BertTokenizer, BertTokenizerFast

    ours = build_tokenizer(kind, vocab_file=minilm_vocab)
    shutil.copy(minilm_vocab, tmp_path / "vocab.txt")
    slow = BertTokenizer.from_pretrained(str(tmp_path), do_lower_case=lower)
    fast = BertTokenizerFast.from_pretrained(str(tmp_path), do_lower_case=lower)
    for t in CONTROL_AND_FORMAT:
        want = slow(t, add_special_tokens=False)["input_ids"]
        assert fast(t, add_special_tokens=False)["input_ids"] == want, t  # the two references agree
        assert ours.tokenize(t) == want, (t, slow.convert_ids_to_tokens(want))
    assert ours.tokenize_batch(CONTROL_AND_FORMAT) == [ours.tokenize(t) for t in CONTROL_AND_FORMAT]
    # the characters really are dropped, not merged into pieces
    assert ours.tokenize("co\u00adoperate") == ours.tokenize("cooperate")
    assert ours.tokenize("zero\u200bwidth") == ours.tokenize("zerowidth")


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
    with pytest.raises(TokenizerError, match="vocab-size"):
        tok.tokenize("100")
    # Ordinary text: the message names the offending token and the fix, not int()'s complaint.
    with pytest.raises(TokenizerError, match=r"already token ids .* found 'Hello'; .* --tokenizer-type"):
        tok.tokenize("1 Hello world")


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
    with pytest.raises(TokenizerError, match=match):
        build_tokenizer(**kwargs)


@pytest.mark.parametrize(
    "case,flag,match",
    [
        ("gpt2-vocab-is-merges", "--vocab-file", "not JSON .* pass a GPT-2 vocab.json"),
        ("gpt2-vocab-is-text", "--vocab-file", "not JSON"),
        ("gpt2-vocab-is-json-list", "--vocab-file", "not an object of token -> integer id"),
        ("gpt2-vocab-is-binary", "--vocab-file", "not UTF-8 text"),
        ("gpt2-merges-is-vocab", "--merge-file", "no BPE model can be built .* pass a GPT-2 merges.txt"),
        ("gpt2-vocab-is-directory", "--vocab-file", "is a directory"),
        ("bert-vocab-is-gpt2-json", "--vocab-file", r"lacks \[CLS\].* looks like a JSON vocabulary"),
        ("bert-vocab-is-binary", "--vocab-file", "cannot be read as a vocabulary .* pass a BERT WordPiece vocab.txt"),
        ("spm-model-is-text", "--tokenizer-model", "not a SentencePiece model .* pass a SentencePiece .model file"),
        ("spm-model-missing", "--tokenizer-model", "no such file"),
        ("hf-dir-without-tokenizer", "--tokenizer-model", "no Hugging Face tokenizer could be loaded .* save_pretrained"),
    ],
)
def test_wrong_kind_of_file_names_flag_file_and_fix(gpt2_files, spm_model, minilm_vocab, tmp_path, case, flag, match):
    """Each tokenizer given a file of the wrong kind says which flag and file, and what the file must be."""
    vocab, merges = gpt2_files
    text = tmp_path / "notes.txt"
    text.write_text("just some notes\n")
    json_list = tmp_path / "list.json"
    json_list.write_text("[1, 2, 3]")
    (tmp_path / "empty_dir").mkdir()
    kwargs, path = {
        "gpt2-vocab-is-merges": (dict(tokenizer_type="GPT2BPETokenizer", vocab_file=merges, merge_file=merges), merges),
        "gpt2-vocab-is-text": (dict(tokenizer_type="GPT2BPETokenizer", vocab_file=str(text), merge_file=merges), str(text)),
        "gpt2-vocab-is-json-list": (dict(tokenizer_type="GPT2BPETokenizer", vocab_file=str(json_list), merge_file=merges), str(json_list)),
        "gpt2-vocab-is-binary": (dict(tokenizer_type="GPT2BPETokenizer", vocab_file=spm_model, merge_file=merges), spm_model),
        "gpt2-merges-is-vocab": (dict(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=vocab), vocab),
        "gpt2-vocab-is-directory": (dict(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path), merge_file=merges), str(tmp_path)),
        "bert-vocab-is-gpt2-json": (dict(tokenizer_type="BertWordPieceLowerCase", vocab_file=vocab), vocab),
        "bert-vocab-is-binary": (dict(tokenizer_type="BertWordPieceCase", vocab_file=spm_model), spm_model),
        "spm-model-is-text": (dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=minilm_vocab), minilm_vocab),
        "spm-model-missing": (dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model="/nope.model"), "/nope.model"),
        "hf-dir-without-tokenizer": (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "empty_dir")),
                                     str(tmp_path / "empty_dir")),
    }[case]
    with pytest.raises(TokenizerError) as err:
        build_tokenizer(**kwargs)
    message = str(err.value)
    assert message.startswith(f"{flag} {path}"), message
    assert re.search(match, message), message


@pytest.fixture(scope="session")
def hf_style_tokenizers(corpus, workdir):
    """style -> a Hugging Face tokenizer directory trained here in Llama 3's and Qwen's style."""
    from megatron_patch.data.train_tokenizer import train

    out = {}
    for style in ("llama3", "qwen"):
        train(style, [corpus], str(workdir / f"tok_{style}"), 3000, style)
        out[style] = str(workdir / f"tok_{style}")
    return out


@pytest.mark.parametrize("style,eod", [("llama3", "<|end_of_text|>"), ("qwen", "<|endoftext|>")])
def test_model_directory_tokenizer_gives_transformers_ids_and_its_end_of_text(style, eod, hf_style_tokenizers, corpus,
                                                                             texts, tmp_path):
    """tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR with a Llama 3-style
    (tiktoken split, digits in threes, BOS) and a Qwen-style (digits one by one, no BOS) tokenizer.json: every
    document is transformers' ids of it, without BOS, followed by the model's end-of-text token."""
    from transformers import AutoTokenizer

    d = hf_style_tokenizers[style]
    hf = AutoTokenizer.from_pretrained(d)
    samples = ["Numbers 1234567 and 42.", "  two  spaces\n\nand lines", "it's we'll THEY'RE", "ünïcödé ≠ ascii 🙂"]
    digits = hf("1234567", add_special_tokens=False)["input_ids"]
    assert len(digits) == (3 if style == "llama3" else 7), hf.convert_ids_to_tokens(digits)  # the styles' digit rule
    src = tmp_path / "docs.jsonl"
    docs = samples + texts[:300]
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    run_tool("preprocess_data.py", "--input", str(src), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
             "HuggingFaceTokenizer", "--tokenizer-model", d, "--append-eod", "--workers", "2")
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    assert ds.num_documents == len(docs)
    end = hf.convert_tokens_to_ids(eod)
    assert hf.eos_token_id == end
    for i, text in enumerate(docs):
        want = hf(text, add_special_tokens=False)["input_ids"] + [end]
        assert ds[i].tolist() == want, (i, text[:60])
        assert hf.decode(ds[i].tolist()[:-1]) == text
