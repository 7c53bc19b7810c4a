"""Writing a task's demo corpus (task_corpora) to disk, and `tools/make_finetune_data.py`'s command line.

`write_task_dataset` writes train/validation(/test) files and, for the two classification tasks,
`label_names.json` ({"label": [...]} or {"ner_tags": [...]}), which `finetune_data.load_finetune_dataset`
reads to turn those columns into ClassLabel features.
"""
from __future__ import annotations

import json
import os
from collections import Counter

from megatron_patch.demo.task_corpora import CLASS_NAMES, TASKS, build_task_rows
from megatron_patch.demo.task_tags import TAG_NAMES
from megatron_patch.demo.task_units import HEADLINE_WORDS

FORMATS = ("jsonl", "csv", "parquet")


def check_format(task: str, fmt: str) -> None:
    """Raise ValueError unless `fmt` can hold `task`'s rows."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: choose one of {list(FORMATS)}")
    if fmt == "csv" and task in ("token_classification", "question_answering"):
        raise ValueError(f"{task} rows hold lists, which CSV cannot; use jsonl or parquet")


def write_rows(task: str, rows: dict[str, list[dict]], out_dir: str, fmt: str = "jsonl") -> list[str]:
    """Write `{split}.{fmt}` for each split (plus label_names.json for the classification tasks) into
    `out_dir`, replacing split files of any format already there; return the paths written."""
    check_format(task, fmt)
    os.makedirs(out_dir, exist_ok=True)
    # Stale files (train.csv next to a new train.jsonl) would make the loader's layout ambiguous.
    for name in os.listdir(out_dir):
        stem, ext = os.path.splitext(name)
        if (stem in ("train", "validation", "test") and ext in (".jsonl", ".json", ".csv", ".parquet")) \
                or name == "label_names.json":
            os.remove(os.path.join(out_dir, name))
    written = []
    for split, split_rows in rows.items():
        path = os.path.join(out_dir, f"{split}.{fmt}")
        if fmt == "jsonl":
            with open(path, "w", encoding="utf-8") as f:
                for r in split_rows:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
        else:
            import datasets  # Dataset.from_list stays in memory: nothing goes to the Hugging Face cache

            quiet = datasets.are_progress_bars_disabled()
            datasets.disable_progress_bars()  # one bar per file is noise for a few hundred rows
            try:
                ds = datasets.Dataset.from_list(split_rows)
                ds.to_csv(path, index=False) if fmt == "csv" else ds.to_parquet(path)
            finally:
                if not quiet:
                    datasets.enable_progress_bars()
        written.append(path)
    names = {"sequence_classification": {"label": CLASS_NAMES},
             "token_classification": {"ner_tags": TAG_NAMES}}.get(task)
    if names:
        path = os.path.join(out_dir, "label_names.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(names, f)
        written.append(path)
    return written


def write_task_dataset(task: str, out_dir: str, n_train: int, n_valid: int, n_test: int = 0,
                       seed: int = 1234, fmt: str = "jsonl") -> str:
    """Build a `task` dataset from the stdlib's docstrings and write it into `out_dir`; return out_dir.

    Files: `train.{fmt}`, `validation.{fmt}`, `test.{fmt}` when n_test > 0, and `label_names.json` for
    sequence_classification/token_classification. `fmt` is jsonl (default), csv (flat tasks) or parquet.
    The same task, sizes and seed give identical files (on one Python version).
    """
    check_format(task, fmt)
    write_rows(task, build_task_rows(task, n_train, n_valid, n_test, seed), out_dir, fmt)
    return out_dir


def describe_rows(task: str, rows: dict[str, list[dict]]) -> list[str]:
    """One line per split: its size and label balance (classes, tags) or mean lengths."""
    lines = []
    for split, split_rows in rows.items():
        if task == "sequence_classification":
            c = Counter(r["label"] for r in split_rows)
            detail = ", ".join(f"{CLASS_NAMES[k]}={c[k]}" for k in range(len(CLASS_NAMES)))
        elif task == "token_classification":
            c = Counter(t for r in split_rows for t in r["ner_tags"])
            detail = ", ".join(f"{name}={c[k]}" for k, name in enumerate(TAG_NAMES))
            detail += f"; rows with a tag: {sum(any(r['ner_tags']) for r in split_rows)}"
        elif task == "question_answering":
            mean = sum(len(r["context"].split()) for r in split_rows) / max(len(split_rows), 1)
            detail = f"mean context {mean:.1f} words"
        elif task == "seq2seq_lm":
            mean = sum(len(r["source"].split()) for r in split_rows) / max(len(split_rows), 1)
            detail = f"mean source {mean:.1f} words, target {HEADLINE_WORDS} words"
        else:
            mean = sum(len(r["text"].split()) for r in split_rows) / max(len(split_rows), 1)
            detail = f"mean text {mean:.1f} words"
        lines.append(f"{split}: {len(split_rows)} rows ({detail})")
    return lines


def main(argv: list[str] | None = None) -> None:
    """`tools/make_finetune_data.py`: write a task dataset and print its files and label balance."""
    import argparse
    import time

    p = argparse.ArgumentParser(description="Write a small fine-tuning dataset for a --task, made offline from "
                                            "the Python standard library's docstrings.")
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--output-dir", required=True, help="directory for train/validation/test files")
    p.add_argument("--train-samples", type=int, default=2000)
    p.add_argument("--valid-samples", type=int, default=200)
    p.add_argument("--test-samples", type=int, default=0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--format", default="jsonl", choices=FORMATS, help="file format (csv only for flat tasks)")
    a = p.parse_args(argv)
    start = time.time()
    try:
        check_format(a.task, a.format)
        rows = build_task_rows(a.task, a.train_samples, a.valid_samples, a.test_samples, a.seed)
        paths = write_rows(a.task, rows, a.output_dir, a.format)
    except ValueError as e:
        p.exit(2, f"error: {e}\n")
    for path in paths:
        print(f"wrote {path}")
    for line in describe_rows(a.task, rows):
        print(line)
    print(f"{a.task}: done in {time.time() - start:.1f}s (seed {a.seed})")
