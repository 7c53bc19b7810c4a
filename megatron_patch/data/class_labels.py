"""Class labels of a fine-tuning dataset: a split directory's `label_names.json` (e.g. `{"label": ["neg", "pos"]}`
or `{"ner_tags": ["O", "B-CODE", ...]}`) turns those columns into `ClassLabel` (`List(ClassLabel)` for token
tags); `label_names` and `encode_labels` give the names and make any label column hold class ids."""
from __future__ import annotations

import json
import os

import datasets
from datasets import ClassLabel, DatasetDict, Features

from megatron_patch.data.finetune_error import FinetuneDataError

LABEL_NAMES_FILE = "label_names.json"


def apply_label_names_file(dd: DatasetDict, folder: str) -> DatasetDict:
    """The columns that `folder`'s label_names.json names, cast to ClassLabel in every split; `dd` as it is
    without that file. A file that is not {column: [class names...]} raises FinetuneDataError."""
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
