"""tools/preprocess_data.py against megatron-core's own writer, byte for byte.

Each case runs the tool as a user does (a subprocess) and compares its .bin and .idx with files that
megatron-core's `IndexedDatasetBuilder` writes from ids of a tokenizer that shares no code with ours,
assembled the way Megatron-LM's tools/preprocess_data.py does it (one sequence per sentence, the
end-of-document id appended to a document's last sequence, Megatron's uint16/int32 rule):

- GPT-2 BPE: `tokenizers.ByteLevelBPETokenizer` built from the same vocab.json/merges.txt (ours builds
  its own BPE model, pre-tokenizer and decoder; transformers' GPT2TokenizerFast given the two files
  returns no ids, see DESIGN.md).
- WordPiece: the real MiniLM model's own tokenizer.json (what Hugging Face loads for that model), as
  ours is built from its vocab.txt through `tokenizers.BertWordPieceTokenizer`.
- int32: a vocabulary of 65,500 entries or more is needed, and no such tokenizer can be downloaded
  here, nor trained from the small test corpus. NullTokenizer is Megatron's own tokenizer for data that
  already holds ids: `--vocab-size 70000` makes 70,001 entries (one for end-of-document), and the text
  can carry ids above 65,535, the ones a uint16 file would corrupt. Its reference is a plain int parse.

With `--split-sentences` the reference splits with our `megatron_patch.data.sentences.split_sentences`:
the splitter has tests of its own and is not what is compared here. The text input spans two chunks
of 512 lines; the id input spans six, more than the four that two workers keep in flight, so their
results must come back in input order.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT
from megatron_patch.data.sentences import split_sentences

TEXT_DOCS = 600  # two chunks: the real text is the slow part
ID_DOCS = 6 * 512 - 100  # six chunks, the last one partial


@pytest.fixture(scope="module")
def text_slice(texts, tmp_path_factory):
    """The first TEXT_DOCS corpus documents as JSONL, and their texts."""
    path = tmp_path_factory.mktemp("parity") / "slice.jsonl"
    docs = texts[:TEXT_DOCS]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return str(path), docs


@pytest.fixture(scope="module")
def id_slice(tmp_path_factory):
    """ID_DOCS documents of integer ids below 70000, many of them above 65535, written Megatron's way ('1 2 3')."""
    rng = np.random.default_rng(0)
    docs = [" ".join(map(str, rng.integers(0, 70000, rng.integers(1, 40)).tolist())) for _ in range(ID_DOCS)]
    docs[0] = "65535 65536 69999 0"  # the uint16 boundary, for certain
    path = tmp_path_factory.mktemp("parity_ids") / "ids.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return str(path), docs


def run_preprocess(*args):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def reference_files(prefix, docs, encode, eod, vocab_size, split):
    """Megatron-LM's preprocess flow with megatron-core's builder; returns the dtype it chose."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(vocab_size)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for text in docs:
        ids, lengths = [], []
        for sentence in split_sentences(text) if split else [text]:
            sentence_ids = encode(sentence)
            if sentence_ids:
                ids.extend(sentence_ids)
                lengths.append(len(sentence_ids))
        # Ours skips (and reports) a document with no tokens; Megatron-LM would write it empty. The
        # slices have none, so the two agree.
        assert ids, f"document tokenized to nothing: {text[:80]!r}"
        if eod is not None:
            ids.append(eod)
            lengths[-1] += 1
        builder.add_document(torch.tensor(ids, dtype=torch.int64), lengths)
    builder.finalize(prefix + ".idx")
    return dtype


def assert_same_bytes(ours_prefix, ref_prefix):
    for ext in (".bin", ".idx"):
        with open(ours_prefix + ext, "rb") as f:
            ours = f.read()
        with open(ref_prefix + ext, "rb") as f:
            ref = f.read()
        if ours != ref:
            first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
            pytest.fail(f"{ext} differs from megatron-core's: {len(ours)} vs {len(ref)} bytes, first difference at byte {first}")


def gpt2_reference(gpt2_files):
    from tokenizers import ByteLevelBPETokenizer

    ref = ByteLevelBPETokenizer(*gpt2_files)  # add_prefix_space=False, as GPT-2 (and Megatron-LM) encode
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2_files[0], "--merge-file", gpt2_files[1]]
    return flags, (lambda t: ref.encode(t).ids), ref.token_to_id("<|endoftext|>"), ref.get_vocab_size()


def wordpiece_reference(minilm_vocab):
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(os.path.join(os.path.dirname(minilm_vocab), "tokenizer.json"))
    ref.no_truncation()  # the model ships with truncation at 128 tokens and padding on
    ref.no_padding()
    flags = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", minilm_vocab]
    # Megatron-LM's BERT tokenizers end a document with [SEP].
    return flags, (lambda t: ref.encode(t, add_special_tokens=False).ids), ref.token_to_id("[SEP]"), ref.get_vocab_size()


CASES = [
    # tokenizer, --split-sentences, --append-eod, --workers, dtype megatron-core must pick
    ("gpt2", False, True, 1, np.uint16),
    ("gpt2", True, True, 2, np.uint16),
    ("wordpiece", True, False, 2, np.uint16),
    ("wordpiece", False, True, 1, np.uint16),
    ("null", False, True, 2, np.int32),
    ("null", False, False, 1, np.int32),
]


@pytest.mark.parametrize(
    "kind,split,eod,workers,dtype", CASES,
    ids=[f"{k}-{'sentence' if s else 'document'}-{'eod' if e else 'noeod'}-w{w}" for k, s, e, w, _ in CASES],
)
def test_bytes_match_megatron_core_builder(kind, split, eod, workers, dtype, gpt2_files, minilm_vocab, text_slice,
                                           id_slice, tmp_path):
    if kind == "null":
        src, docs = id_slice
        flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "70000"]
        # Megatron's NullTokenizer: ids separated by spaces; 70000 entries plus one, the end-of-document id.
        encode, eod_id, vocab_size = (lambda t: [int(x) for x in t.split(" ")]), 70000, 70001
    else:
        src, docs = text_slice
        flags, encode, eod_id, vocab_size = gpt2_reference(gpt2_files) if kind == "gpt2" else wordpiece_reference(minilm_vocab)
    extra = (["--split-sentences"] if split else []) + (["--append-eod"] if eod else [])
    run_preprocess("--input", src, "--output-prefix", str(tmp_path / "ours"), "--workers", str(workers), *flags, *extra)
    level = "sentence" if split else "document"
    ref_dtype = reference_files(str(tmp_path / "ref"), docs, encode, eod_id if eod else None, vocab_size, split)
    assert ref_dtype == dtype  # the case covers the vocabulary size it claims to
    assert_same_bytes(str(tmp_path / f"ours_text_{level}"), str(tmp_path / "ref"))
    assert sorted(os.listdir(tmp_path)) == sorted([f"ours_text_{level}.bin", f"ours_text_{level}.idx", "ref.bin", "ref.idx"])
