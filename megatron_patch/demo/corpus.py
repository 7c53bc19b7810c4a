"""A real English corpus available offline on any machine: the docstrings of Python's standard library
plus the language-reference topics that ship with it (pydoc_data.topics), about 2 MB on Python 3.12.

The documents are read from the stdlib's source files with `ast` (nothing is imported or executed),
in sorted file order, so the same Python version always yields the same corpus.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sysconfig
import warnings
from typing import Iterator, Tuple

MIN_CHARS = 60  # shorter docstrings are mostly signatures ("Return self+value."), not prose


def iter_stdlib_docstrings(min_chars: int = MIN_CHARS) -> Iterator[Tuple[str, str]]:
    """Yield (source, docstring) for module, class and function docstrings of the stdlib."""
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            try:
                with open(path, encoding="utf-8") as f:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        tree = ast.parse(f.read(), filename=path)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node, clean=True)
                    if doc and len(doc) >= min_chars:
                        label = module if isinstance(node, ast.Module) else f"{module}.{node.name}"
                        yield label, doc
    from pydoc_data.topics import topics  # the language reference as plain text

    for key in sorted(topics):
        if len(topics[key]) >= min_chars:
            yield f"pydoc_data.topics.{key}", topics[key].strip()


def build_demo_corpus(output: str, max_bytes: int = 4_000_000, min_chars: int = MIN_CHARS) -> Tuple[int, int]:
    """Write up to `max_bytes` of JSONL ({"text", "source"}) to `output`; return (documents, bytes)."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    docs = written = 0
    seen = set()
    tmp = output + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for source, text in iter_stdlib_docstrings(min_chars):
            if text in seen:  # inherited/duplicated docstrings would skew a small corpus
                continue
            seen.add(text)
            line = json.dumps({"text": text, "source": source}, ensure_ascii=False) + "\n"
            size = len(line.encode("utf-8"))
            if written + size > max_bytes:
                break
            f.write(line)
            docs += 1
            written += size
    os.replace(tmp, output)
    return docs, written


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Build a JSONL corpus of real English text from the stdlib's docstrings.")
    p.add_argument("--output", required=True, help="JSONL file to write")
    p.add_argument("--max-mb", type=float, default=4.0, help="stop after this many MB (default 4)")
    p.add_argument("--min-chars", type=int, default=MIN_CHARS, help="skip docstrings shorter than this")
    a = p.parse_args(argv)
    docs, size = build_demo_corpus(a.output, int(a.max_mb * 1e6), a.min_chars)
    print(f"wrote {docs} documents, {size / 1e6:.2f} MB to {a.output}")


if __name__ == "__main__":
    main()
