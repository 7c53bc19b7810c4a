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
class ids (class_labels.py). `megatron_patch.demo.task_files.write_task_dataset` writes this file.

Bad files fail in one sentence naming the file and the position: an empty file, bytes that are not UTF-8
(line), a JSON syntax error (line and column) (split_files.py), a split without a column the task reads (the columns found,
and the flag that names it: `task_columns.find_task_columns`).
"""
from __future__ import annotations

import os

import datasets
from datasets import DatasetDict

from megatron_patch.data.class_labels import apply_label_names_file
from megatron_patch.data.finetune_error import FinetuneDataError
from megatron_patch.data.hf_offline import offline_mode
from megatron_patch.data.split_files import SPLIT_ALIASES, find_split_files, read_split_files

FIX_HINT = ("pass --data-path DIR with train/validation/test .jsonl/.json/.csv/.parquet files, or a "
            "directory saved with DatasetDict.save_to_disk (--data-name is then the configuration/"
            "subdirectory inside it)")


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
    if folder == base and not _is_saved_dataset_dict(base) and "train" not in find_split_files(base) \
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
    files = find_split_files(folder)
    if "train" not in files:
        raise FinetuneDataError(
            f"--data-path: no train split in {folder!r} (expected train.jsonl, train.json, train.csv or "
            f"train.parquet); files found: {_listing(folder)}. {FIX_HINT[0].upper()}{FIX_HINT[1:]}")
    loaded = read_split_files(files, folder)
    loaded = apply_label_names_file(loaded, folder)
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
