"""The input side of preprocessing (preprocess.py): the files `--input` names, read as raw line chunks; and the
error every stage of it raises for bad input or flags."""
from __future__ import annotations

import glob
import os
from typing import Iterator, List, Tuple

CHUNK_LINES = 512
CHUNK_BYTES = 1 << 20


class PreprocessError(Exception):
    """Bad input or flags. The message names the file:line (or the flag) and the fix; `main` prints it and exits 1."""


def resolve_inputs(spec: str) -> List[str]:
    """Input files of `--input`: a file, a directory (its .json/.jsonl files) or a glob; sorted."""
    if os.path.isdir(spec):
        names = glob.glob(os.path.join(spec, "*.json")) + glob.glob(os.path.join(spec, "*.jsonl"))
        files = sorted(f for f in names if os.path.isfile(f))
    elif os.path.isfile(spec):
        files = [spec]
    else:
        files = sorted(f for f in glob.glob(spec) if os.path.isfile(f))
    if not files:
        raise PreprocessError(f"--input {spec}: no such file, and no .json/.jsonl files match it")
    return files


Chunk = Tuple[str, int, List[bytes]]  # path, line number of the first line, raw (undecoded) lines


def iter_chunks(files: List[str]) -> Iterator[Chunk]:
    """Raw lines of every file in bounded chunks that never cross a file boundary.

    Lines stay bytes here: the encoder decodes each one by itself, so a line that is not UTF-8 is
    reported with its exact number (or skipped with --skip-bad-lines) like any other bad line.
    """
    for path in files:
        try:
            with open(path, "rb") as f:
                start, lines, size = 1, [], 0
                for lineno, line in enumerate(f, 1):
                    lines.append(line)
                    size += len(line)
                    if len(lines) >= CHUNK_LINES or size >= CHUNK_BYTES:
                        yield path, start, lines
                        start, lines, size = lineno + 1, [], 0
                if lines:
                    yield path, start, lines
        except OSError as e:
            raise PreprocessError(f"--input {path}: cannot read it ({e.strerror or e})") from None
