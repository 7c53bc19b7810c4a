"""Small fine-tuning datasets for every `--task`, made offline from real English text.

The text is the Python standard library's docstrings (`megatron_patch.demo.corpus.iter_stdlib_docstrings`), read in a
fixed order, so a seed and a Python version always give the same files. Row shapes follow the public
datasets the CLI is used with:

* sequence_classification  GLUE-MRPC: {"idx", "sentence1", "sentence2", "label"}; label 1
  ("consecutive") when sentence2 follows sentence1 in the same docstring, 0 ("not_consecutive") when
  sentence2 comes from another package's docstring. Exactly half (rounded up) of each split is 1.
* token_classification     CoNLL: {"id", "tokens", "ner_tags"} with BIO tags O, B-CODE, I-CODE, B-NUM.
  CODE marks identifiers (`os.path.join()`, `max_size`, `SequenceMatcher`, a call with its arguments as
  B-CODE I-CODE...); NUM marks numbers. At least two thirds of the rows have a non-O tag.
* question_answering       SQuAD: {"id", "title", "context", "question", "answers": {"text": [..],
  "answer_start": [..]}}. The context is one to three docstring sentences; the questions are "Which
  identifier is mentioned first?", "... last?" (when the last differs) and "Which number is mentioned
  first?", the answers the CODE/NUM spans tagged as above -- spans a tiny model can learn to point at in
  a few hundred steps, since they look different from the words around them.
* masked_lm, casual_lm, causal_lm   {"text"}: one docstring, paragraphs kept, cut at 200 words.
* seq2seq_lm               {"source", "target"}: source is one docstring paragraph (12 to 64 words),
  target its first 8 words (a "headline"), which a small encoder-decoder learns to copy quickly.

Splits are made by package (`email.mime.text.MIMEText` belongs to `email`): a package's docstrings go to
one split only, chosen at random (from the seed) in proportion to what each split still needs. A sentence
is used at most once across the whole dataset (repeats, e.g. inherited docstrings, are dropped), so no
sentence appears in two splits. Reading stops as soon as every split is full, which keeps
n_train=2000 to a few seconds.

The tagging is `task_tags`, a row's material cut from one docstring `task_units`, and `task_files` writes
the rows to disk (`write_task_dataset`).
"""
from __future__ import annotations

import random
from typing import Iterator

from megatron_patch.demo.corpus import iter_stdlib_docstrings
from megatron_patch.demo.task_units import doc_units

TASKS = ("sequence_classification", "token_classification", "question_answering", "masked_lm",
         "casual_lm", "causal_lm", "seq2seq_lm")
CLASS_NAMES = ["not_consecutive", "consecutive"]


# ------------------------------------------------------------------------------------------- the text


def _group(source: str) -> str:
    # The top-level package: its modules share vocabulary and sentences, so they stay in one split.
    # The language-reference topics are independent documents.
    return source if source.startswith("pydoc_data.") else source.split(".")[0]


def _documents() -> Iterator[tuple[str, str, str]]:
    for source, doc in iter_stdlib_docstrings():
        yield _group(source), source, doc


# --------------------------------------------------------------------------------- splits and rows


def build_task_rows(task: str, n_train: int, n_valid: int, n_test: int = 0,
                    seed: int = 1234) -> dict[str, list[dict]]:
    """{split: rows} for `task` with exactly the asked sizes; deterministic for a seed.

    Raises ValueError for an unknown task, bad sizes, or more rows than the stdlib's text gives.
    """
    if task not in TASKS:
        raise ValueError(f"--task {task!r}: choose one of {list(TASKS)}")
    if n_train < 1 or n_valid < 1 or n_test < 0:
        raise ValueError(f"sizes must be train >= 1, validation >= 1, test >= 0; got {n_train}, {n_valid}, {n_test}")
    needs = {"train": n_train, "validation": n_valid}
    if n_test:
        needs["test"] = n_test
    rng = random.Random(seed)
    pools: dict[str, list] = {s: [] for s in needs}
    negatives: dict[str, list[tuple[str, str]]] = {s: [] for s in needs}  # (group, sentence)
    groups: dict[str, set[str]] = {s: set() for s in needs}
    tagged = {s: 0 for s in needs}  # token_classification: units with a non-O tag
    pair_task = task == "sequence_classification"  # negatives need a second package in every split

    def usable(split: str) -> int:
        if task != "token_classification":
            return len(pools[split])
        # at most one tag-free sentence for every two tagged ones (<= 1/3 of the rows)
        return tagged[split] + min(len(pools[split]) - tagged[split], tagged[split] // 2)

    def wanted(split: str) -> int:
        # what a split still needs; a pair-task split with one package needs another for its negatives
        return max(needs[split] - usable(split), 0) + (1 if pair_task and len(groups[split]) < 2 else 0)

    assigned: dict[str, str | None] = {}
    seen: set[str] = set()
    for group, source, doc in _documents():
        if group not in assigned:
            weights = {s: wanted(s) for s in needs}
            if not any(weights.values()):
                break
            # weighted choice by what is still missing, so every split fills at about the same time
            assigned[group] = rng.choices(list(weights), weights=list(weights.values()))[0]
        split = assigned[group]
        if not wanted(split):
            continue  # full: skip the text without using it (keeps the split a closed set of packages)
        units, sentences = doc_units(task, source, doc, seen, rng)
        pools[split] += [(group, u) for u in units]
        negatives[split] += [(group, s) for s in sentences]
        if task == "token_classification":
            tagged[split] += sum(any(tags) for _, tags in units)
        if units:
            groups[split].add(group)
    short = {s: f"{usable(s)}/{needs[s]}" for s in needs if wanted(s)}
    if short:
        raise ValueError(f"the stdlib docstrings give too few {task} examples (per split, found/asked: {short}); "
                         f"ask for fewer samples")
    rows = {}
    for split, n in needs.items():
        units = pools[split]
        rng.shuffle(units)
        if task == "token_classification":
            with_tags = [u for u in units if any(u[1][1])]
            plain = [u for u in units if not any(u[1][1])]
            n_plain = min(len(plain), n // 3, n)
            n_plain = max(n_plain, n - len(with_tags))
            units = with_tags[:n - n_plain] + plain[:n_plain]
            rng.shuffle(units)
        rows[split] = _rows(task, split, units[:n], negatives[split], rng)
    return rows


def _rows(task: str, split: str, units: list, negatives: list[tuple[str, str]], rng: random.Random) -> list[dict]:
    if task == "sequence_classification":
        n_pos = (len(units) + 1) // 2
        rows = []
        for k, (group, (s1, s2)) in enumerate(units):
            label = 1
            if k >= n_pos:
                label = 0
                other = group
                while other == group:  # another package of the same split: never consecutive, no leak
                    other, s2 = rng.choice(negatives)
            rows.append({"sentence1": s1, "sentence2": s2, "label": label})
        rng.shuffle(rows)
        return [{"idx": i, **r} for i, r in enumerate(rows)]
    if task == "token_classification":
        return [{"id": str(i), "tokens": t, "ner_tags": g} for i, (_, (t, g)) in enumerate(units)]
    if task == "question_answering":
        rows = []
        for i, (_, (source, context, question, start, end)) in enumerate(units):
            answer = context[start:end]
            assert answer and context[start:start + len(answer)] == answer
            rows.append({"id": f"{split}-{i}", "title": source, "context": context, "question": question,
                         "answers": {"text": [answer], "answer_start": [start]}})
        return rows
    if task == "seq2seq_lm":
        return [{"source": s, "target": t} for _, (s, t) in units]
    return [{"text": t} for _, t in units]
