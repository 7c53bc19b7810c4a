"""megatron_patch.demo.package_text and tools/build_text_corpus.py on a small fake install directory (a second)."""
import json
import os

import pytest

from conftest import run_tool
from megatron_patch.demo.package_text import (CorpusStats, build_package_corpus, c_comments, iter_package_documents,
                                              python_comments)

PROSE = "The quick brown fox jumps over the lazy dog while the documentation explains every parameter. "
MODULE_DOC = "Module a: " + PROSE * 2
CLASS_DOC = "Class Thing: " + PROSE
SHARED_DOC = "Shared helper docstring copied into two modules: " + PROSE
README = "# Package b\n\n" + PROSE * 3


def _write(root, rel: str, text, mode: str = "w") -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, mode) as f:
        f.write(text)


@pytest.fixture
def fake_site(tmp_path):
    """A site-packages-like tree: its files are listed here in the sorted order they are walked."""
    root = str(tmp_path / "site")
    _write(root, "a_pkg/__init__.py", "")  # no docstring: too short
    _write(root, "a_pkg/broken.py", '"""A docstring long enough to count. ' + PROSE + '"""\ndef f(:\n')
    _write(root, "a_pkg/mod.py",
           f'"""{MODULE_DOC}"""\n# a comment about the class below\nclass Thing:\n    """{CLASS_DOC}"""\n\n'
           f'    def run(self):\n        """{SHARED_DOC}"""\n        return 1  # the answer\n')
    _write(root, "a_pkg/native.h", "/* Native code: " + PROSE * 2 + "*/\n// Returns one.\nint one();\n")
    _write(root, "a_pkg/tiny.txt", "too short to keep")
    _write(root, "b_pkg/README.md", README)
    _write(root, "b_pkg/copy/README.md", README)  # the same README vendored twice: a duplicate document
    _write(root, "b_pkg/latin1.txt", ("caf\xe9 " + PROSE).encode("latin-1"), "wb")
    _write(root, "b_pkg/other.py", f'def helper():\n    """{SHARED_DOC}"""\n\n\ndef own():\n    """Own: {PROSE * 3}"""\n')
    _write(root, "b_pkg/__pycache__/stale.py", f'"""{PROSE * 3}"""\n')  # never read
    _write(root, "b_pkg/site-packages/nested.py", f'"""{PROSE * 3}"""\n')  # another interpreter's: not read
    return root


def test_documents_dedup_and_skips(fake_site):
    stats = CorpusStats()
    docs = list(iter_package_documents([fake_site], stats=stats))
    assert docs == [
        f"{MODULE_DOC.strip()}\n\n{CLASS_DOC.strip()}\n\n{SHARED_DOC.strip()}",  # a_pkg/mod.py, in source order
        README.strip(),  # b_pkg/README.md; b_pkg/copy/README.md is its duplicate
        f"Own: {PROSE * 3}".strip(),  # b_pkg/other.py without the docstring already read in mod.py
    ]
    assert (stats.python_files, stats.header_files, stats.doc_files) == (4, 0, 4)  # headers: only with comments
    assert (stats.syntax_errors, stats.not_utf8, stats.too_large, stats.files_skipped) == (1, 1, 0, 2)
    assert [os.path.relpath(p, fake_site) for p in stats.skipped_paths] == ["a_pkg/broken.py", "b_pkg/latin1.txt"]
    assert stats.duplicates == 2 and stats.too_short == 2  # README copy + shared docstring; __init__.py + tiny.txt
    # min_chars=0 keeps the short file, never an empty document (a_pkg/__init__.py)
    assert list(iter_package_documents([fake_site], min_chars=0)) == [docs[0], "too short to keep", *docs[1:]]


def test_corpus_is_byte_identical_and_capped(fake_site, tmp_path):
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    stats = build_package_corpus(a, [fake_site])
    build_package_corpus(b, [fake_site])
    assert open(a, "rb").read() == open(b, "rb").read()
    rows = [json.loads(line) for line in open(a, encoding="utf-8")]
    assert all(list(r) == ["text"] for r in rows) and len(rows) == stats.documents == 3
    assert stats.characters == sum(len(r["text"]) for r in rows)
    assert build_package_corpus(a, [fake_site], max_docs=2).documents == 2 and len(open(a).readlines()) == 2
    assert not os.path.exists(a + ".tmp")


def test_code_text_comments_and_source(fake_site):
    with_comments = list(iter_package_documents([fake_site], code_text="comments"))
    assert with_comments[0].endswith(f"{SHARED_DOC.strip()}\n\na comment about the class below\n\nthe answer")
    assert with_comments[1] == "Native code: " + (PROSE * 2).strip() + "\n\nReturns one."  # a_pkg/native.h
    source = list(iter_package_documents([fake_site], code_text="source"))
    assert source[0].startswith(f'"""{MODULE_DOC}"""\n# a comment') and "int one();" in source[1]
    with pytest.raises(ValueError, match="choose one of docstrings, comments, source"):
        list(iter_package_documents([fake_site], code_text="all"))
    with pytest.raises(FileNotFoundError, match="no such directory"):
        list(iter_package_documents([fake_site + "/missing"]))


def test_comment_readers():
    assert python_comments("#!/usr/bin/env python\n# -*- coding: utf-8 -*-\n# one\n# two\n\n# type: ignore\n# ---\n"
                           "x = '# not a comment'  # three\n") == ["one two", "three"]
    src = '/* Copyright\n * Line two.\n */\nchar* u = "http://x.org"; // trailing\n// next line\n/** Doc. */\n// ===\n'
    assert c_comments(src) == ["Copyright\nLine two.", "trailing next line", "Doc."]


def test_cli(fake_site, tmp_path):
    out = str(tmp_path / "corpus.jsonl")
    proc = run_tool("build_text_corpus.py", "--output", out, "--root", fake_site)
    assert "3 documents" in proc.stdout and "skipped 2 files (1 syntax errors, 1 not UTF-8" in proc.stdout
    assert len(open(out).readlines()) == 3
    proc = run_tool("build_text_corpus.py", "--output", out, "--root", str(tmp_path / "none"), check=False)
    assert proc.returncode == 2 and "--root" in proc.stderr and "no such directory" in proc.stderr
