"""tools/preprocess_data.py as users run it: the documented command, workers, partitions, bad input."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, run_tool
from megatron_patch.data.indexed_dataset import IndexedDataset
from megatron_patch.data.tokenizers import build_tokenizer


def files_of(prefix):
    return {ext: open(prefix + ext, "rb").read() for ext in (".bin", ".idx")}


def test_documented_command_verbatim(corpus, gpt2_files, tmp_path, texts):
    """The command of the Rapidformer how-to, with local files under the names it uses."""
    vocab, merges = gpt2_files
    shutil.copy(corpus, tmp_path / "book_wiki_owtv2_small.json")
    shutil.copy(vocab, tmp_path / "gpt2-vocab.json")
    shutil.copy(merges, tmp_path / "gpt2-merges.txt")
    cmd = ("python preprocess_data.py --input book_wiki_owtv2_small.json --output-prefix gpt_small "
           "--vocab gpt2-vocab.json --dataset-impl mmap --tokenizer-type GPT2BPETokenizer "
           "--merge-file gpt2-merges.txt --append-eod").split()
    shutil.copy(os.path.join(ROOT, "tools", "preprocess_data.py"), tmp_path / "preprocess_data.py")
    proc = subprocess.run([sys.executable] + cmd[1:], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "docs/s" in proc.stderr and "MB/s" in proc.stderr
    ds = IndexedDataset(str(tmp_path / "gpt_small_text_document"))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert ds.num_documents == len(texts) == len(ds)
    for i in (0, 1, len(texts) // 2, len(texts) - 1):
        assert ds[i].tolist() == tok.tokenize(texts[i]) + [tok.eod]
    assert ds.dtype == np.uint16


def _gpt_args(corpus, gpt2_files, prefix, *extra):
    vocab, merges = gpt2_files
    return ["--input", corpus, "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", vocab, "--merge-file", merges, "--append-eod", *extra]


@pytest.mark.parametrize("split", [False, True])
def test_workers_and_partitions_are_byte_identical(corpus, gpt2_files, tmp_path, split):
    extra = ["--split-sentences"] if split else []
    level = "sentence" if split else "document"
    outs = {}
    for name, more in {"w1": ["--workers", "1"], "w2": ["--workers", "2"], "p3": ["--workers", "2", "--partitions", "3"]}.items():
        run_tool("preprocess_data.py", *_gpt_args(corpus, gpt2_files, str(tmp_path / name), *extra, *more))
        outs[name] = files_of(str(tmp_path / f"{name}_text_{level}"))
    assert outs["w1"] == outs["w2"] == outs["p3"]
    assert not [f for f in os.listdir(tmp_path) if "part" in f or f.endswith(".tmp")]


def test_split_sentences_and_keys(tmp_path, gpt2_files):
    src = tmp_path / "two_keys.jsonl"
    src.write_text(json.dumps({"text": "First sentence here. Second one follows! A third?", "title": "A title."}) + "\n")
    run_tool("preprocess_data.py", *_gpt_args(str(src), gpt2_files, str(tmp_path / "o"), "--split-sentences",
                                              "--json-keys", "text", "title"))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])
    ds = IndexedDataset(str(tmp_path / "o_text_sentence"))
    assert ds.num_documents == 1 and len(ds) == 3
    assert ds[0].tolist() == tok.tokenize("First sentence here.")
    assert ds[2].tolist() == tok.tokenize("A third?") + [tok.eod]  # eod ends the document, not each sentence
    assert IndexedDataset(str(tmp_path / "o_title_sentence"))[0].tolist() == tok.tokenize("A title.") + [tok.eod]


def test_directory_and_glob_inputs(tmp_path, gpt2_files):
    d = tmp_path / "in"
    d.mkdir()
    for i in range(3):
        (d / f"part{i}.jsonl").write_text(json.dumps({"text": f"document number {i}"}) + "\n")
    run_tool("preprocess_data.py", *_gpt_args(str(d), gpt2_files, str(tmp_path / "dir")))
    run_tool("preprocess_data.py", *_gpt_args(str(d / "part*.jsonl"), gpt2_files, str(tmp_path / "glob")))
    assert files_of(str(tmp_path / "dir_text_document")) == files_of(str(tmp_path / "glob_text_document"))
    assert IndexedDataset(str(tmp_path / "dir_text_document")).num_documents == 3


def _bad_file(tmp_path, lines):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b"".join((ln if isinstance(ln, bytes) else ln.encode()) + b"\n" for ln in lines))
    return str(p)


def _outputs(tmp_path, prefix="o"):
    """Files the tool left for prefix `prefix`: published pairs, .tmp files and part files alike."""
    return sorted(f for f in os.listdir(tmp_path) if f.startswith(prefix + "_"))


def _run_with_timeout(*args, timeout=120):
    """tools/preprocess_data.py in a fresh interpreter; a hang fails the test instead of blocking it."""
    try:
        return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"preprocess_data.py {' '.join(args)} still running after {timeout} s (hang); stderr: {e.stderr!r}")


@pytest.mark.parametrize(
    "bad_line,message",
    [
        ('{"text": "unterminated', "not valid JSON"),
        ('{"body": "no text key"}', "has no key 'text'"),
        ('["a", "list"]', "not an object"),
        ('{"text": 42}', "not a string"),
    ],
)
def test_bad_line_stops_with_position(tmp_path, gpt2_files, bad_line, message):
    src = _bad_file(tmp_path, ['{"text": "good one"}', bad_line, '{"text": "good two"}'])
    proc = run_tool("preprocess_data.py", *_gpt_args(src, gpt2_files, str(tmp_path / "o")), check=False)
    assert proc.returncode != 0
    assert f"{src}:2: " in proc.stderr and message in proc.stderr and "--skip-bad-lines" in proc.stderr
    assert not [f for f in os.listdir(tmp_path) if f.startswith("o_")]  # nothing half-written is published


@pytest.mark.parametrize("workers,bad_line", [(1, 51), (1, 551), (2, 51), (2, 551)])
def test_invalid_utf8_stops_at_its_line_without_hanging(tmp_path, gpt2_files, workers, bad_line):
    """A byte that is not UTF-8 stops the run with the exact line, in both chunks (512 lines each) and
    with workers: before, --workers 2 hung forever (the error died in Pool.imap's feeder thread) and
    --workers 1 named a line near the start of the file's read buffer."""
    lines = [json.dumps({"text": f"document {i} of the file."}).encode() for i in range(1, 601)]
    lines[bad_line - 1] = b'{"text": "caf\xe9 is Latin-1, not UTF-8"}'
    src = _bad_file(tmp_path, lines)
    proc = _run_with_timeout(*_gpt_args(src, gpt2_files, str(tmp_path / "o"), "--workers", str(workers)))
    assert proc.returncode == 1, proc.stderr
    assert f"{src}:{bad_line}: not valid UTF-8 (byte 0xe9 at byte 14 of the line" in proc.stderr, proc.stderr
    assert "re-encode the file as UTF-8" in proc.stderr and "Traceback" not in proc.stderr
    assert _outputs(tmp_path) == []  # no .bin.tmp, nothing published


def test_worker_that_dies_is_reported_not_waited_for(tmp_path, gpt2_files):
    """A worker killed while it holds a chunk (here it exits at once) ends the run with the lines it held,
    exit 1 and no output; a multiprocessing.Pool would wait for that chunk forever."""
    src = _bad_file(tmp_path, ['{"text": "good one"}', '{"text": "good two"}'])
    script = ("import os, sys\n"
              "import megatron_patch.data.preprocess as p\n"
              "import megatron_patch.data.preprocess_pool as pool\n"
              "def die(chunk):\n    os._exit(3)\n"
              "pool._worker_encode = die\n"
              "p.main(sys.argv[1:])\n")
    try:
        proc = subprocess.run([sys.executable, "-c", script, *_gpt_args(src, gpt2_files, str(tmp_path / "o"), "--workers", "2")],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("a dead worker left the run waiting (hang)")
    assert proc.returncode == 1, proc.stderr
    assert f"error: {src}:1-2: a --workers process died while encoding these lines" in proc.stderr, proc.stderr
    assert _outputs(tmp_path) == []


def test_skip_bad_lines_counts_and_reports(tmp_path, gpt2_files):
    src = _bad_file(tmp_path, ['{"text": "good one"}', b'{"text": "caf\xe9"}', "not json", '{"body": 1}', "", '{"text": ""}',
                               '{"text": "good two"}'])
    proc = run_tool("preprocess_data.py", *_gpt_args(src, gpt2_files, str(tmp_path / "o"), "--skip-bad-lines"))
    assert f"skipped 3 bad line(s) (--skip-bad-lines); first: {src}:2: not valid UTF-8" in proc.stderr
    assert f"skipped 1 empty document(s) that tokenized to nothing; first: {src}:6" in proc.stderr
    assert "skipped 1 blank line(s)" in proc.stderr
    assert IndexedDataset(str(tmp_path / "o_text_document")).num_documents == 2


def test_empty_document_is_reported_not_written(tmp_path, gpt2_files):
    src = _bad_file(tmp_path, ['{"text": ""}', '{"text": "real"}'])
    proc = run_tool("preprocess_data.py", *_gpt_args(src, gpt2_files, str(tmp_path / "o")))
    assert "skipped 1 empty document(s)" in proc.stderr and f"{src}:1" in proc.stderr
    assert IndexedDataset(str(tmp_path / "o_text_document")).num_documents == 1


def test_missing_input_and_bad_flags(tmp_path, gpt2_files):
    proc = run_tool("preprocess_data.py", *_gpt_args(str(tmp_path / "none.jsonl"), gpt2_files, str(tmp_path / "o")), check=False)
    assert proc.returncode != 0 and "--input" in proc.stderr and "none.jsonl" in proc.stderr
    # A real input, no --vocab-file: the error names the missing flag, in one line, and writes nothing.
    src = _bad_file(tmp_path, ['{"text": "good one"}'])
    proc = run_tool("preprocess_data.py", "--input", src, "--output-prefix", str(tmp_path / "o"),
                    "--tokenizer-type", "GPT2BPETokenizer", check=False)
    assert proc.returncode != 0, proc.stderr
    assert "GPT2BPETokenizer needs --vocab-file PATH" in proc.stderr and "Traceback" not in proc.stderr
    assert _outputs(tmp_path) == []


@pytest.mark.parametrize(
    "lines,extra",
    [
        ([], []),
        (["", "   "], ["--workers", "2"]),
        (["not json", '{"body": "no text key"}'], ["--skip-bad-lines"]),
        (['{"text": ""}', ""], ["--workers", "2", "--partitions", "2"]),
    ],
    ids=["empty-file", "blank-lines", "only-bad-lines-skipped", "only-empty-documents-partitions"],
)
def test_input_without_documents_is_an_error(tmp_path, gpt2_files, lines, extra):
    """An input that yields no document would give an empty dataset that fails only at training time."""
    src = _bad_file(tmp_path, lines) if lines else str(tmp_path / "bad.jsonl")
    if not lines:
        open(src, "w").close()
    proc = _run_with_timeout(*_gpt_args(src, gpt2_files, str(tmp_path / "o"), *extra))
    assert proc.returncode == 1, proc.stderr
    assert f"{src}: the input produced no documents for key(s) 'text' ({len(lines)} line(s) read" in proc.stderr, proc.stderr
    assert "Nothing was written" in proc.stderr and "Traceback" not in proc.stderr
    assert _outputs(tmp_path) == []  # neither an empty pair nor part files


def test_tokenizer_errors_name_file_line_and_fix(tmp_path, gpt2_files):
    """NullTokenizer on ordinary text (raised inside a worker) and a merges.txt given as --vocab-file."""
    src = _bad_file(tmp_path, ['{"text": "1 2 3"}', '{"text": "4 five 6"}'])
    proc = _run_with_timeout("--input", src, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "NullTokenizer",
                             "--vocab-size", "100", "--workers", "2")
    assert proc.returncode == 1, proc.stderr
    assert f"{src}:2: key 'text': NullTokenizer reads text that is already token ids" in proc.stderr, proc.stderr
    assert "'five'" in proc.stderr and "--tokenizer-type" in proc.stderr and "Traceback" not in proc.stderr
    vocab, merges = gpt2_files
    proc = _run_with_timeout(*_gpt_args(src, (merges, merges), str(tmp_path / "o")))
    assert proc.returncode == 1, proc.stderr
    assert f"--vocab-file {merges}: not JSON" in proc.stderr and "--merge-file" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert _outputs(tmp_path) == []


def test_bert_and_sentencepiece_outputs(corpus, minilm_vocab, spm_model, tmp_path, texts):
    run_tool("preprocess_data.py", "--input", corpus, "--output-prefix", str(tmp_path / "bert"), "--tokenizer-type",
             "BertWordPieceLowerCase", "--vocab-file", minilm_vocab, "--split-sentences", "--workers", "2")
    ds = IndexedDataset(str(tmp_path / "bert_text_sentence"))
    assert ds.num_documents == len(texts) and len(ds) > 2 * len(texts)
    run_tool("preprocess_data.py", "--input", corpus, "--output-prefix", str(tmp_path / "spm"), "--tokenizer-type",
             "SentencePieceTokenizer", "--tokenizer-model", spm_model, "--append-eod")
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=spm_model)
    assert IndexedDataset(str(tmp_path / "spm_text_document"))[3].tolist() == tok.tokenize(texts[3]) + [tok.eod]
