"""The split files of a fine-tuning dataset directory: found by name, read with datasets, and a bad file
reported in one sentence naming the file and the position (an empty file, bytes that are not UTF-8 (line), a
JSON syntax error (line and column), a CSV header without rows)."""
from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Iterator, Optional

import datasets
from datasets import DatasetDict

from megatron_patch.data.finetune_error import FinetuneDataError
from megatron_patch.data.hf_offline import offline_mode

SPLIT_ALIASES = {
    "train": ("train",),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test",),
}
BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def find_split_files(folder: str) -> dict[str, list[str]]:
    """{split: files} for the split files directly in `folder`; raises on ambiguous layouts."""
    found: dict[str, list[str]] = {}
    for split, aliases in SPLIT_ALIASES.items():
        for alias in aliases:
            for ext in BUILDERS:
                paths = [os.path.join(folder, alias + ext)]
                paths += sorted(glob.glob(os.path.join(glob.escape(folder), f"{alias}-*{ext}")))
                paths = [p for p in paths if os.path.isfile(p)]
                if not paths:
                    continue
                if split in found:  # e.g. train.jsonl and train.csv, or dev.jsonl and validation.jsonl
                    names = sorted(os.path.basename(p) for p in found[split] + paths)
                    raise FinetuneDataError(
                        f"--data-path {folder!r} has more than one {split} split file: {names}; keep one")
                found[split] = paths
    return found


def read_split_files(files: dict[str, list[str]], folder: str) -> DatasetDict:
    """The splits of `find_split_files(folder)` as a DatasetDict; a bad or empty file raises FinetuneDataError."""
    # Faults datasets/pyarrow report without a position (an empty file) or not at all (bytes that are not
    # UTF-8 load, and fail later in tokenization) are looked for first; a file they cannot parse is then
    # read again here to find the line.
    for paths in files.values():
        for path in paths:
            check_file(path)
    # One load_dataset call per file format: the json, csv and parquet builders each read one format.
    by_builder: dict[str, dict[str, list[str]]] = {}
    for split, paths in files.items():
        by_builder.setdefault(BUILDERS[os.path.splitext(paths[0])[1]], {})[split] = paths
    out = DatasetDict()
    for builder, data_files in by_builder.items():
        try:
            with offline_mode(), _quiet():
                loaded = datasets.load_dataset(builder, data_files=data_files)
        except Exception as e:
            paths = [p for v in data_files.values() for p in v]
            fault = next((f for f in map(_read_fault, paths) if f), None)
            if fault:
                raise FinetuneDataError(fault) from e
            raise FinetuneDataError(
                f"--data-path {folder!r}: cannot read {sorted(os.path.basename(p) for p in paths)} as {builder}: "
                f"{_root_cause(e)}") from e
        out.update(loaded)
    for split, paths in files.items():
        if split in out and len(out[split]) == 0:  # a CSV header alone, a JSON `[]`
            raise FinetuneDataError(f"{', '.join(paths)}: no rows (the {split} split is empty): add rows, or "
                                    "remove the file if the split is optional (test)")
    return out


_TEXT_FORMATS = (".jsonl", ".json", ".csv")
_READ_CHUNK = 1 << 22  # bytes per UTF-8 check: whole lines, so a fault's line number is found in one chunk


def check_file(path: str) -> None:
    """Raise FinetuneDataError for an empty split file, or for bytes that are not UTF-8 (file and line)."""
    if os.path.getsize(path) == 0:
        raise FinetuneDataError(f"{path} is empty (no rows): add rows, or remove the file if the split is "
                                "optional (test)")
    if not path.endswith(_TEXT_FORMATS):
        return
    blank, line = True, 1  # line: the number of the first line of the chunk
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_READ_CHUNK)
            if not chunk:
                break
            chunk += f.readline()  # end on a line boundary
            try:
                text = chunk.decode("utf-8")
            except UnicodeDecodeError as e:
                raise FinetuneDataError(_utf8_fault(path, chunk, e.start, e.end, line)) from None
            blank = blank and not text.strip()
            line += chunk.count(b"\n")
    if blank:
        raise FinetuneDataError(f"{path} holds only blank lines (no rows): add rows, or remove the file if the "
                                "split is optional (test)")


def _utf8_fault(path: str, chunk: bytes, offset: int, end: int, first_line: int) -> str:
    start = chunk.rfind(b"\n", 0, offset) + 1
    line = first_line + chunk.count(b"\n", 0, offset)
    return (f"{path}, line {line}: bytes that are not UTF-8 ({chunk[offset:end]!r} at byte {offset - start + 1} "
            "of the line); save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE)")


def _read_fault(path: str) -> Optional[str]:
    """Why datasets could not read a text split file, as 'FILE...: ...', or None when no fault is found here."""
    if path.endswith(".csv"):
        with open(path, encoding="utf-8") as f:
            rows = sum(1 for line in f if line.strip())
        return f"{path}: a header but no rows: add rows, or remove the file if the split is optional (test)" \
            if rows <= 1 else None
    return _json_fault(path) if path.endswith((".json", ".jsonl")) else None


def _json_fault(path: str) -> Optional[str]:
    """The first JSON syntax error of a .json/.jsonl file as 'FILE, line N: ...', or None if it parses."""
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):  # one JSON document, or JSON Lines under a .json name
            text = f.read()
            try:
                document = json.loads(text)
                return f"{path}: no rows (an empty JSON document): add rows" if not document else None
            except json.JSONDecodeError as whole:
                first = next((ln for ln in text.split("\n") if ln.strip()), "")
                try:
                    json.loads(first)
                except json.JSONDecodeError:  # not JSON Lines either: the document's own position
                    return f"{path}, line {whole.lineno}: not valid JSON ({whole.msg}, column {whole.colno})"
            lines = text.split("\n")
        else:
            lines = f
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line.rstrip("\r\n"))  # a column past the end is then reported on this line
            except json.JSONDecodeError as e:
                return (f"{path}, line {number}: not valid JSON ({e.msg}, column {e.colno}); each line of a JSON "
                        "Lines file is one object {...}")
            if not isinstance(value, dict):
                return (f"{path}, line {number}: a JSON {type(value).__name__} where an object {{...}} (one row) "
                        "is expected")
    return None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """datasets' own error log lines off while it reads files: a fault is reported once, by our message."""
    from datasets.utils import logging as ds_logging

    level = ds_logging.get_verbosity()
    ds_logging.set_verbosity(ds_logging.CRITICAL)
    try:
        yield
    finally:
        ds_logging.set_verbosity(level)


def _root_cause(e: BaseException) -> str:
    """The innermost cause's message, on one line (datasets wraps the parser's error in its own)."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__
