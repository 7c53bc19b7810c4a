"""A larger real-text corpus available offline: the documentation of the installed Python and its packages.

Read from the interpreter's install directories (the standard library and site-packages), in sorted path order,
with nothing imported or executed. What each file gives is ONE document:

- a documentation file (`.md`, `.rst`, `.txt`, or a bare METADATA / README / LICENSE / COPYING / NOTICE / AUTHORS
  file, such as the `.dist-info` METADATA that holds a package's long description): its text;
- a Python file (`.py`, `.pyi`), by `code_text`: "docstrings" (the default), its module, class and function
  docstrings in source order, read with `ast`; "comments", those and then its `#` comments (read with `tokenize`);
  "source", the whole file. A file that `ast` cannot parse (Python 2 sources, templates, tests of the parser) is
  skipped and counted, and so is one that is not UTF-8 where its text is needed;
- a C/C++ header (`.h`, `.hh`, `.hpp`, `.hxx`, `.cuh`; torch ships thousands), read only when `code_text` is
  "comments" (its `/* */` and `//` comments) or "source" (the whole file).

A document's parts (docstrings, comment blocks) are joined by blank lines. Documents shorter than `min_chars` are
dropped, and duplicates too, by hash: a whole document seen before (the same LICENSE or README vendored by several
packages), and each docstring or comment block seen before (docstrings copied from model to model, license headers,
`Initialize self.`-style boilerplate). The same environment therefore yields the same documents in the same order,
and `build_package_corpus` writes byte-identical JSONL.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import os
import re
import site
import sysconfig
import tokenize
import warnings
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Set

MIN_CHARS = 200  # shorter documents are mostly one-line signatures or empty METADATA, not prose
MAX_FILE_BYTES = 4_000_000  # larger files are data (vocabularies, word lists, generated tables), not prose
DOC_SUFFIXES = (".md", ".rst", ".txt")
DOC_NAMES = ("METADATA", "README", "LICENSE", "LICENCE", "COPYING", "NOTICE", "AUTHORS")
PY_SUFFIXES = (".py", ".pyi")
HEADER_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".cuh")
# site-packages below a root is another interpreter's packages (the base Python's, under the stdlib of a venv's
# interpreter): read only when named as a root itself.
SKIP_DIRS = ("__pycache__", ".git", ".hg", ".svn", "node_modules", "site-packages", "dist-packages")
CODE_TEXT = ("docstrings", "comments", "source")

# A C/C++ comment, or a string/char literal (matched so that "http://..." inside one is not read as a comment).
_C_TOKEN = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|/\*.*?\*/|//[^\n]*', re.S)
_PRAGMAS = ("!", "-*-", "type:", "noqa", "pragma", "pylint:", "fmt:", "NOLINT", "clang-format", "namespace")


@dataclass
class CorpusStats:
    """What a walk read, kept and skipped; `files_skipped` is the total of the three skip reasons."""

    python_files: int = 0
    header_files: int = 0
    doc_files: int = 0
    syntax_errors: int = 0  # Python files that `ast` cannot parse
    not_utf8: int = 0  # files that are not UTF-8 text
    too_large: int = 0  # files over MAX_FILE_BYTES
    too_short: int = 0  # documents under min_chars
    duplicates: int = 0  # documents, docstrings and comment blocks seen before
    documents: int = 0
    characters: int = 0
    skipped_paths: List[str] = field(default_factory=list)  # the files skipped, to look at what was left out

    @property
    def files_skipped(self) -> int:
        return self.syntax_errors + self.not_utf8 + self.too_large

    def summary(self) -> str:
        """One paragraph for the CLI."""
        return (f"{self.documents} documents, {self.characters} characters ({self.characters / 1e6:.1f} M); "
                f"read {self.python_files} Python, {self.header_files} C/C++ header and {self.doc_files} "
                f"documentation files; skipped {self.files_skipped} files ({self.syntax_errors} syntax errors, "
                f"{self.not_utf8} not UTF-8, {self.too_large} over {MAX_FILE_BYTES // 1_000_000} MB); dropped "
                f"{self.duplicates} duplicate documents or parts and {self.too_short} documents under the minimum length")


def default_roots() -> List[str]:
    """The current interpreter's install directories: its standard library and its site-packages, sorted."""
    paths = sysconfig.get_paths()
    candidates = [paths["stdlib"], paths["purelib"], paths["platlib"], *site.getsitepackages()]
    return sorted({os.path.realpath(p) for p in candidates if os.path.isdir(p)})


def iter_files(roots: Sequence[str], code_text: str = "docstrings") -> Iterator[str]:
    """The files under `roots` that give documents, in sorted order (links to directories not followed)."""
    suffixes = PY_SUFFIXES + DOC_SUFFIXES + (HEADER_SUFFIXES if code_text != "docstrings" else ())
    real = sorted({os.path.realpath(r) for r in roots})
    for root in real:
        if not os.path.isdir(root):
            raise FileNotFoundError(f"{root}: no such directory to read documents from")
        for dirpath, dirnames, filenames in os.walk(root):
            # A root inside another is read once, on its own turn.
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS
                                 and os.path.realpath(os.path.join(dirpath, d)) not in real)
            for name in sorted(filenames):
                if name.endswith(suffixes) or name in DOC_NAMES:
                    path = os.path.join(dirpath, name)
                    if os.path.isfile(path):
                        yield path


def python_docstrings(tree: ast.AST) -> List[str]:
    """Module, class and function docstrings in source order (ast.walk is breadth-first, so sort by line)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and doc.strip():
                found.append((getattr(node, "lineno", 0), doc.strip()))
    return [doc for _, doc in sorted(found, key=lambda item: item[0])]


def _blocks(lines: List[tuple]) -> List[str]:
    """(line number, text) comment lines -> blocks of consecutive lines, pragmas and empty lines left out."""
    blocks: List[List[str]] = []
    last = -2
    for number, text in lines:
        text = text.strip()
        if not text or text.startswith(_PRAGMAS) or not any(c.isalpha() for c in text):
            continue
        if number == last + 1 and blocks:
            blocks[-1].append(text)
        else:
            blocks.append([text])
        last = number
    return [" ".join(block) for block in blocks]


def python_comments(source: str) -> List[str]:
    """The `#` comments of a source, consecutive comment lines joined into one block (shebangs, pragmas dropped)."""
    lines = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                lines.append((tok.start[0], tok.string.lstrip("#")))
    except (tokenize.TokenError, SyntaxError):  # parsed by ast already, so rare: keep what was read
        pass
    return _blocks(lines)


def c_comments(source: str) -> List[str]:
    """The comments of a C/C++ source in order: each `/* */` comment one block (its ` * ` margins removed),
    consecutive `//` lines one block."""
    blocks: List[str] = []
    run: List[tuple] = []  # the current run of // lines: (line number, text)
    line, pos = 0, 0
    for match in _C_TOKEN.finditer(source):
        line += source.count("\n", pos, match.start())
        pos = match.start()
        token = match.group(0)
        if token.startswith("//"):
            run.append((line, token.lstrip("/!<")))
        elif token.startswith("/*"):
            blocks += _blocks(run)
            run = []
            lines = [text.strip().lstrip("*!<").strip() for text in token[2:-2].strip("*!<").split("\n")]
            blocks += _blocks([(0, "\n".join(text for text in lines if text))])
    return blocks + _blocks(run)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12).digest()


class _Reader:
    """Turns files into documents, with the dedup state and the counters of one walk."""

    def __init__(self, min_chars: int, code_text: str, stats: CorpusStats):
        if code_text not in CODE_TEXT:
            raise ValueError(f"code_text={code_text!r}: choose one of {', '.join(CODE_TEXT)}")
        self.min_chars, self.code_text, self.stats = min_chars, code_text, stats
        self.seen_docs: Set[bytes] = set()
        self.seen_parts: Set[bytes] = set()

    def _skip(self, path: str, reason: str) -> None:
        setattr(self.stats, reason, getattr(self.stats, reason) + 1)
        self.stats.skipped_paths.append(path)

    def _join_new(self, parts: List[str]) -> str:
        """The parts (docstrings, comment blocks) not seen before in this walk, joined by blank lines."""
        kept = []
        for part in parts:
            key = _digest(part)
            if key in self.seen_parts:
                self.stats.duplicates += 1
                continue
            self.seen_parts.add(key)
            kept.append(part)
        return "\n\n".join(kept)

    def _decode(self, path: str, raw: bytes) -> Optional[str]:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self._skip(path, "not_utf8")
            return None

    def read(self, path: str) -> Optional[str]:
        """The document of one file, or None (skipped, too short or a duplicate; counted in stats)."""
        if os.path.getsize(path) > MAX_FILE_BYTES:
            self._skip(path, "too_large")
            return None
        with open(path, "rb") as f:
            raw = f.read()
        if path.endswith(PY_SUFFIXES):
            self.stats.python_files += 1
            text = self._python_text(path, raw)
        elif path.endswith(HEADER_SUFFIXES):
            self.stats.header_files += 1
            text = self._decode(path, raw)
            if text is not None and self.code_text == "comments":
                text = self._join_new(c_comments(text))
        else:
            self.stats.doc_files += 1
            text = self._decode(path, raw)
        if text is None:
            return None
        text = text.replace("\r\n", "\n").replace("\r", "\n").strip()
        # Lone surrogates (from "\ud800" escapes in docstrings) cannot be written as UTF-8.
        text = text.encode("utf-8", "replace").decode("utf-8")
        if not text or len(text) < self.min_chars:  # an empty document is dropped whatever min_chars says
            self.stats.too_short += 1
            return None
        key = _digest(text)
        if key in self.seen_docs:
            self.stats.duplicates += 1
            return None
        self.seen_docs.add(key)
        return text

    def _python_text(self, path: str, raw: bytes) -> Optional[str]:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # SyntaxWarning: invalid escape sequences in old sources
                tree = ast.parse(raw, filename=path)
        except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: null bytes
            self._skip(path, "syntax_errors")
            return None
        if self.code_text == "docstrings":
            return self._join_new(python_docstrings(tree))
        source = self._decode(path, raw)  # a source in another encoding (a coding cookie) parses but is skipped here
        if source is None or self.code_text == "source":
            return source
        return self._join_new(python_docstrings(tree) + python_comments(source))


def iter_package_documents(roots: Optional[Sequence[str]] = None, min_chars: int = MIN_CHARS,
                           code_text: str = "docstrings", stats: Optional[CorpusStats] = None) -> Iterator[str]:
    """Yield the documents of the files under `roots` (default: default_roots()), deduplicated, in sorted file order.

    `code_text` chooses what source files contribute: "docstrings" (of Python files), "comments" (Python
    docstrings and comments, C/C++ header comments) or "source" (whole Python files and headers). Pass a
    CorpusStats to read the counters as the walk goes.
    """
    reader = _Reader(min_chars, code_text, stats if stats is not None else CorpusStats())
    for path in iter_files(default_roots() if roots is None else roots, code_text):
        text = reader.read(path)
        if text is not None:
            yield text


def build_package_corpus(output: str, roots: Optional[Sequence[str]] = None, min_chars: int = MIN_CHARS,
                         max_docs: Optional[int] = None, code_text: str = "docstrings") -> CorpusStats:
    """Write the documents as JSONL ({"text": ...} per line) to `output` (atomically) and return the counters."""
    stats = CorpusStats()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = output + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for text in iter_package_documents(roots, min_chars, code_text, stats):
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            stats.documents += 1
            stats.characters += len(text)
            if max_docs is not None and stats.documents >= max_docs:
                break
    os.replace(tmp, output)
    return stats


def main(argv: Optional[Sequence[str]] = None) -> CorpusStats:
    p = argparse.ArgumentParser(description="Build a JSONL corpus ({\"text\": ...} per line) from the docstrings and "
                                            "documentation files of the installed Python and its packages, offline.")
    p.add_argument("--output", required=True, help="JSONL file to write")
    p.add_argument("--root", action="append", default=None,
                   help="a directory to read (repeatable; default: this interpreter's standard library and "
                        "site-packages: " + ", ".join(default_roots()) + ")")
    p.add_argument("--min-chars", type=int, default=MIN_CHARS,
                   help=f"drop documents shorter than this (default {MIN_CHARS})")
    p.add_argument("--max-docs", type=int, default=None, help="stop after this many documents")
    p.add_argument("--code-text", choices=CODE_TEXT, default="docstrings",
                   help="what source files contribute: Python docstrings (default); docstrings, # comments and "
                        "C/C++ header comments; or whole Python files and headers")
    a = p.parse_args(argv)
    if a.min_chars < 0:
        p.error(f"--min-chars {a.min_chars}: must be 0 or more")
    if a.max_docs is not None and a.max_docs < 1:
        p.error(f"--max-docs {a.max_docs}: must be 1 or more")
    for root in a.root or []:
        if not os.path.isdir(root):
            p.error(f"--root {root}: no such directory")
    stats = build_package_corpus(a.output, a.root, a.min_chars, a.max_docs, a.code_text)
    print(f"wrote {a.output}: {stats.summary()}", flush=True)
    return stats


if __name__ == "__main__":
    main()
