"""Sentence splitting, the demo corpus and tools/train_tokenizer.py."""
import json
import os

from conftest import run_tool
from megatron_patch.demo.corpus import build_demo_corpus
from megatron_patch.data.sentences import split_sentences


def test_sentence_splitter():
    text = 'Dr. Smith met J. R. Tolkien. He said "Hi!" Then e.g. this runs. Call os.path.join. 3 items? Yes.'
    assert split_sentences(text) == [
        "Dr. Smith met J. R. Tolkien.", 'He said "Hi!"', "Then e.g. this runs.", "Call os.path.join.", "3 items?", "Yes."
    ]
    assert split_sentences("Line one\nwraps.\n\nNew paragraph") == ["Line one wraps.", "New paragraph"]
    assert split_sentences("Line one\nwraps.", keep_newlines=True) == ["Line one\nwraps."]
    assert split_sentences("   ") == []


def test_splitter_keeps_all_words(texts):
    for t in texts[:200]:
        assert " ".join(split_sentences(t)).split() == t.split()


def test_demo_corpus_is_deterministic_real_text(tmp_path):
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    assert build_demo_corpus(a, 200_000) == build_demo_corpus(b, 200_000)
    assert open(a).read() == open(b).read()
    docs = [json.loads(line) for line in open(a)]
    words = " ".join(d["text"] for d in docs).lower().split()
    assert sum(w in ("the", "a", "of", "to", "is") for w in words) / len(words) > 0.05  # English prose


def test_train_tokenizer_cli(corpus, tmp_path):
    for kind, files in [("gpt2", ["gpt2-vocab.json", "gpt2-merges.txt"]), ("sentencepiece", ["sentencepiece.model"]),
                        ("wordpiece", ["wordpiece-vocab.txt"])]:
        proc = run_tool("train_tokenizer.py", "--type", kind, "--input", corpus, "--output-dir", str(tmp_path),
                        "--vocab-size", "1000")
        assert "wrote" in proc.stdout
        assert all(os.path.getsize(tmp_path / f) > 0 for f in files)
    vocab = json.load(open(tmp_path / "gpt2-vocab.json"))
    assert len(vocab) == 1000 and "<|endoftext|>" in vocab
    proc = run_tool("train_tokenizer.py", "--type", "gpt2", "--input", str(tmp_path / "none"), "--output-dir",
                    str(tmp_path), check=False)
    assert proc.returncode != 0 and "no such file" in proc.stderr
