"""Fine-tuning datasets for the `rapidformer` CLI, loaded offline.

`--data-path` names one of:

* a local directory of split files: `train.*` plus `validation.*` (also `dev.*`, `valid.*`, `val.*`)
  and optionally `test.*`, each `.jsonl`, `.json`, `.csv` or `.parquet`; sharded files such as
  `train-00000-of-00002.parquet` (the Hugging Face Hub's parquet layout) count too. The files may sit in
  the subdirectory `--data-name` (the configuration, e.g. `glue/mrpc/train.jsonl`), in `data/` (the
  Hub's default layout) or in `--data-dir` (relative to `--data-path`, or an absolute path). A
  `--data-name` must name something: a subdirectory, or the directory itself (`--data-path glue/mrpc
  --data-name mrpc`); any other name is refused rather than ignored;
* a directory written by `DatasetDict.save_to_disk` (or its subdirectory `--data-name`);
* a dataset name already in the local Hugging Face cache (`glue` with `--data-name mrpc`), read with
  offline mode forced: nothing is ever downloaded.

Label names: a split directory may hold `label_names.json`, e.g. `{"label": ["neg", "pos"]}` or
`{"ner_tags": ["O", "B-CODE", ...]}`; the loader then turns those columns into `ClassLabel`
(`List(ClassLabel)` for token tags), so `label_names()` returns the names and the stored values are the
class ids. `megatron_patch.demo.task_corpora.write_task_dataset` writes this file.

Bad files fail in one sentence naming the file and the position: an empty file, bytes that are not UTF-8
(line), a JSON syntax error (line and column), a split without a column the task reads (the columns found,
and the flag that names it: `task_columns.find_task_columns`).
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Iterator, Optional

import datasets
from datasets import ClassLabel, DatasetDict, Features

SPLIT_ALIASES = {
    "train": ("train",),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test",),
}
BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
LABEL_NAMES_FILE = "label_names.json"

FIX_HINT = ("pass --data-path DIR with train/validation/test .jsonl/.json/.csv/.parquet files, or a "
            "directory saved with DatasetDict.save_to_disk (--data-name is then the configuration/"
            "subdirectory inside it)")


class FinetuneDataError(ValueError):
    """A fine-tuning dataset cannot be found or used; the message names the flag and the fix."""


# ---------------------------------------------------------------------------------------------- loading


def load_finetune_dataset(data_path: str, data_name: str | None = None,
                          data_dir: str | None = None) -> DatasetDict:
    """Load the train/validation(/test) splits named by `--data-path/--data-name/--data-dir`, offline.

    Returns a DatasetDict with keys `train`, `validation` and, when present, `test` (`dev`/`valid`/`val`
    are renamed to `validation`). Raises FinetuneDataError when the data cannot be found, when there is
    no train split, or when there is no validation split (evaluation needs one; nothing is split off
    silently).
    """
    if not data_path:
        raise FinetuneDataError(f"--data-path is empty: {FIX_HINT}")
    if os.path.isfile(data_path):
        raise FinetuneDataError(
            f"--data-path {data_path!r} is a file; it must be a directory holding train/validation "
            f"split files: {FIX_HINT}")
    if os.path.isdir(data_path):
        base = os.path.join(data_path, data_dir) if data_dir else data_path
        if not os.path.isdir(base):
            raise FinetuneDataError(f"--data-dir {data_dir!r}: directory {base!r} does not exist "
                                    f"(it is taken relative to --data-path {data_path!r})")
        return _load_local(base, data_name)
    # --data-path is a name; --data-dir may still point at local files (the parameter guide describes
    # --data-dir as "where the fine-tuning dataset is stored").
    if data_dir and os.path.isdir(data_dir):
        return _load_local(data_dir, data_name)
    return _load_cached(data_path, data_name, data_dir)


def _load_local(base: str, data_name: str | None) -> DatasetDict:
    folder = base
    if data_name and os.path.isdir(os.path.join(base, data_name)):
        folder = os.path.join(base, data_name)
    elif data_name and os.path.basename(os.path.normpath(base)) != data_name:
        # a name that selects nothing would silently train on whatever the directory holds
        subdirs = sorted(d for d in _listing(base) if os.path.isdir(os.path.join(base, d)))
        raise FinetuneDataError(
            f"--data-name {data_name!r}: {base!r} has no subdirectory {data_name!r} (subdirectories: {subdirs}); "
            f"give the configuration's subdirectory, or drop --data-name to use the files in {base!r} itself")
    if folder == base and not _is_saved_dataset_dict(base) and "train" not in _split_files(base) \
            and os.path.isdir(os.path.join(base, "data")):
        folder = os.path.join(base, "data")  # the Hugging Face Hub's usual layout: data/train-*.parquet
    if _is_saved_dataset_dict(folder):
        try:
            loaded = datasets.load_from_disk(folder)
        except Exception as e:  # a truncated or foreign save: say which directory
            raise FinetuneDataError(f"--data-path: cannot read the saved dataset in {folder!r}: {e}") from e
        if not isinstance(loaded, DatasetDict):
            raise FinetuneDataError(
                f"--data-path {folder!r} holds a single saved Dataset without splits; save a DatasetDict "
                f"with 'train' and 'validation' splits instead")
        dd = _check_splits(_rename_splits(loaded, folder), folder)
        return _with_sources(dd, {split: f"{folder} (saved split {split!r})" for split in dd})
    files = _split_files(folder)
    if "train" not in files:
        raise FinetuneDataError(
            f"--data-path: no train split in {folder!r} (expected train.jsonl, train.json, train.csv or "
            f"train.parquet); files found: {_listing(folder)}. {FIX_HINT[0].upper()}{FIX_HINT[1:]}")
    loaded = _load_files(files, folder)
    loaded = _apply_label_names_file(loaded, folder)
    dd = _check_splits(loaded, folder)
    return _with_sources(dd, {split: ", ".join(files[split]) for split in dd})


def _with_sources(dd: DatasetDict, sources: dict[str, str]) -> DatasetDict:
    dd.sources = sources  # what each split was read from, for messages (split_source)
    return dd


def split_source(dd: DatasetDict, split: str) -> str:
    """The file(s) (or saved/cached dataset) a split of `load_finetune_dataset` was read from, for messages."""
    return getattr(dd, "sources", {}).get(split, f"the {split} split")


def _is_saved_dataset_dict(folder: str) -> bool:
    return (os.path.isfile(os.path.join(folder, "dataset_dict.json"))
            or os.path.isfile(os.path.join(folder, "state.json")))


def _split_files(folder: str) -> dict[str, list[str]]:
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


def _load_files(files: dict[str, list[str]], folder: str) -> DatasetDict:
    # Faults datasets/pyarrow report without a position (an empty file) or not at all (bytes that are not
    # UTF-8 load, and fail later in tokenization) are looked for first; a file they cannot parse is then
    # read again here to find the line.
    for paths in files.values():
        for path in paths:
            _check_file(path)
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


def _check_file(path: str) -> None:
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


def _load_cached(name: str, data_name: str | None, data_dir: str | None) -> DatasetDict:
    try:
        with offline_mode():
            loaded = datasets.load_dataset(name, data_name, data_dir=data_dir)
    except Exception as e:
        snapshot = _hub_snapshot(name)
        if snapshot is not None:  # a dataset repository already in the hub cache, read as files
            return load_finetune_dataset(snapshot, data_name, data_dir)
        what = f"--data-path {name!r}" + (f" --data-name {data_name!r}" if data_name else "")
        raise FinetuneDataError(
            f"{what}: {name!r} is not a local directory and is not in the local Hugging Face datasets cache "
            f"({type(e).__name__}: {str(e)[:300]}). Downloading from the Hugging Face Hub is not possible here "
            f"(offline). Instead, {FIX_HINT}.") from e
    if not isinstance(loaded, DatasetDict):
        loaded = DatasetDict({"train": loaded})
    where = f"{name}" + (f"/{data_name}" if data_name else "")
    dd = _check_splits(_rename_splits(loaded, name), where)
    return _with_sources(dd, {split: f"{where} (cached, split {split!r})" for split in dd})


def _hub_snapshot(name: str) -> str | None:
    """The local snapshot directory of hub dataset repository `name`, if the hub cache has one."""
    try:
        import huggingface_hub

        with offline_mode():
            return huggingface_hub.snapshot_download(repo_id=name, repo_type="dataset", local_files_only=True)
    except Exception:
        return None


@contextlib.contextmanager
def offline_mode() -> Iterator[None]:
    """Force datasets and huggingface_hub offline for the duration: no request leaves the machine.

    Both libraries read HF_HUB_OFFLINE once at import, so the module constants are switched as well as the
    environment (the environment covers subprocesses and libraries imported later).
    """
    import huggingface_hub.constants as hub_constants

    saved_env = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    saved = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    os.environ.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rename_splits(dd: DatasetDict, where: str) -> DatasetDict:
    out = DatasetDict()
    for key, ds in dd.items():
        split = next((s for s, aliases in SPLIT_ALIASES.items() if key in aliases), key)
        if split in out:
            raise FinetuneDataError(f"--data-path {where!r} has two {split} splits: {sorted(dd)}; keep one")
        out[split] = ds
    return out


def _check_splits(dd: DatasetDict, where: str) -> DatasetDict:
    if "train" not in dd:
        raise FinetuneDataError(f"--data-path {where!r}: no train split (splits found: {sorted(dd)})")
    empty = sorted(k for k in ("train", "validation", "test") if k in dd and len(dd[k]) == 0)
    if empty:
        raise FinetuneDataError(f"--data-path {where!r}: the {' and '.join(empty)} split has no rows")
    if "validation" not in dd:
        raise FinetuneDataError(
            f"--data-path {where!r}: no validation split (splits found: {sorted(dd)}). Evaluation needs one: "
            f"add validation.jsonl (or dev.jsonl, .json/.csv/.parquet) next to the train file; "
            f"it is not split off the training data silently")
    return DatasetDict({k: dd[k] for k in ("train", "validation", "test") if k in dd})


def _listing(folder: str) -> list[str]:
    try:
        return sorted(os.listdir(folder))[:30]
    except OSError:
        return []


# ------------------------------------------------------------------------------------------ label names


def _apply_label_names_file(dd: DatasetDict, folder: str) -> DatasetDict:
    path = os.path.join(folder, LABEL_NAMES_FILE)
    if not os.path.isfile(path):
        return dd
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        assert isinstance(spec, dict) and all(
            isinstance(v, list) and all(isinstance(n, str) for n in v) for v in spec.values())
    except (ValueError, AssertionError) as e:
        raise FinetuneDataError(f"{path}: expected a JSON object {{column: [class names...]}}") from e
    for column, names in spec.items():
        if column in dd["train"].column_names:
            dd = _to_class_label(dd, column, names, path)
    return dd


def _to_class_label(dd: DatasetDict, column: str, names: list[str], origin: str,
                    by_name: bool = False) -> DatasetDict:
    """Cast `column` (ints or names; or lists of them) to ClassLabel(names) in every split.

    Ints are class ids, strings names; with `by_name` every value is looked up as `str(value)`."""
    index = {n: i for i, n in enumerate(names)}

    def to_id(v):
        if by_name or isinstance(v, str):
            v = str(v)
            if v not in index:
                raise FinetuneDataError(f"{origin}: label {v!r} of column {column!r} is not one of {names}")
            return index[v]
        if not 0 <= int(v) < len(names):
            raise FinetuneDataError(f"{origin}: label id {v} of column {column!r} is outside 0..{len(names) - 1}")
        return int(v)

    out = DatasetDict()
    for split, ds in dd.items():
        feature = ds.features[column]
        nested = hasattr(feature, "feature")
        features = Features(ds.features)
        features[column] = datasets.List(ClassLabel(names=names)) if nested else ClassLabel(names=names)
        out[split] = ds.map(
            lambda b: {column: [[to_id(v) for v in row] if nested else to_id(row) for row in b[column]]},
            batched=True, features=features)
    return out


def label_names(dataset_dict: DatasetDict, label_column: str) -> list[str] | None:
    """Class names for `label_column`, index = class id; None for a regression (float) column.

    From a `ClassLabel` or `List/Sequence(ClassLabel)` feature when there is one (e.g. written with
    `label_names.json`); otherwise the sorted distinct values of the train split (lists are flattened),
    as strings: ints sort numerically (`[1, 2, 10]` -> `["1", "2", "10"]`). With plain values the id of a
    raw label `v` is `names.index(str(v))`; `encode_labels` does this mapping for you.
    """
    train = dataset_dict["train"]
    if label_column not in train.column_names:
        raise FinetuneDataError(f"--label-column {label_column!r} is not a column; columns: {train.column_names}")
    feature = train.features[label_column]
    inner = getattr(feature, "feature", feature)
    if isinstance(inner, ClassLabel):
        return list(inner.names)
    dtype = getattr(inner, "dtype", None)
    if dtype is not None and dtype.startswith("float"):
        return None
    values = set()
    for v in train[label_column]:
        values.update(v if isinstance(v, list) else [v])
    values.discard(None)
    return [str(v) for v in sorted(values)]


def encode_labels(dataset_dict: DatasetDict, label_column: str) -> tuple[DatasetDict, list[str] | None]:
    """Make `label_column` hold class ids (ClassLabel) in every split; return (datasets, names).

    Names come from `label_names`; a validation/test label missing from train raises FinetuneDataError.
    Float (regression) columns are returned unchanged with names None.
    """
    names = label_names(dataset_dict, label_column)
    inner = getattr(dataset_dict["train"].features[label_column], "feature",
                    dataset_dict["train"].features[label_column])
    if names is None or isinstance(inner, ClassLabel):
        return dataset_dict, names
    # Plain ints/strings: the id of a value is the position of str(value) in the sorted names.
    return _to_class_label(dataset_dict, label_column, names, f"--label-column {label_column!r}", by_name=True), names

