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

`write_task_dataset` writes train/validation(/test) files and, for the two classification tasks,
`label_names.json` ({"label": [...]} or {"ner_tags": [...]}), which `finetune_data.load_finetune_dataset`
reads to turn those columns into ClassLabel features.
"""
from __future__ import annotations

import json
import os
import random
import re
from collections import Counter
from typing import Iterator

from megatron_patch.demo.corpus import iter_stdlib_docstrings
from megatron_patch.data.sentences import split_sentences

TASKS = ("sequence_classification", "token_classification", "question_answering", "masked_lm",
         "casual_lm", "causal_lm", "seq2seq_lm")
LM_TASKS = ("masked_lm", "casual_lm", "causal_lm")
CLASS_NAMES = ["not_consecutive", "consecutive"]
TAG_NAMES = ["O", "B-CODE", "I-CODE", "B-NUM"]
QUESTIONS = ("Which identifier is mentioned first?", "Which identifier is mentioned last?",
             "Which number is mentioned first?")
FORMATS = ("jsonl", "csv", "parquet")
LM_MAX_WORDS = 200
HEADLINE_WORDS = 8

O, B_CODE, I_CODE, B_NUM = range(4)
_IDENT = re.compile(r"\.?[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\(\))?")  # .attr: an attribute
_CALL = re.compile(r"\.?[A-Za-z_][\w.]*\(")  # a call written with its arguments: f(x, y)
_CAMEL = re.compile(r"[A-Z]?[a-z]+[A-Z]\w*|[A-Z]{2,}[a-z]\w*")  # SequenceMatcher, getLogger, HTTPServer
_NUM = re.compile(r"[-+]?(?:0[xXoObB][0-9a-fA-F_]+|\d[\d_]*(?:\.\d+)?(?:[eE][-+]?\d+)?)")
_LEAD = "\"'`([{"
_TRAIL = ".,;:!?\"'`"
_CLOSERS = {")": "(", "]": "[", "}": "{"}
MAX_CALL_TOKENS = 12  # an unbalanced "f(" tags at most this many tokens as I-CODE


# ------------------------------------------------------------------------------------- tokens and tags


def word_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each token: whitespace words with quotes, brackets and punctuation split off.

    `os.path.join(),` gives `os.path.join()` and `,`; `(see` gives `(` and `see`; a closing bracket stays
    on a word only when the word opened it (`f(x)` stays whole, `below)` gives `below` and `)`).
    """
    spans = []
    for m in re.finditer(r"\S+", text):
        i, j = m.start(), m.end()
        lead, trail = [], []
        while i < j and text[i] in _LEAD:
            lead.append((i, i + 1))
            i += 1
        while j > i:
            c, word = text[j - 1], text[i:j]
            if c in _TRAIL or (c in _CLOSERS and word.count(_CLOSERS[c]) < word.count(c)):
                trail.append((j - 1, j))
                j -= 1
            else:
                break
        spans += lead + ([(i, j)] if j > i else []) + trail[::-1]
    return spans


def _is_code(token: str) -> bool:
    if _CALL.match(token):
        return True
    if not _IDENT.fullmatch(token):
        return False
    parts = token[:-2].split(".") if token.endswith("()") else token.split(".")
    dotted = len(parts) > 1 and any(len(p) > 1 for p in parts)  # os.path yes, e.g / i.e no
    return "_" in token or token.endswith("()") or dotted or _CAMEL.fullmatch(token) is not None


def tag_tokens(tokens: list[str]) -> list[int]:
    """BIO tag ids (TAG_NAMES) for `tokens`: identifiers are CODE, a call's arguments I-CODE, numbers NUM."""
    tags, depth, left = [], 0, 0
    for tok in tokens:
        if depth > 0 and left > 0:  # inside the arguments of a call started by an earlier token
            tags.append(I_CODE)
            depth += tok.count("(") - tok.count(")")
            left -= 1
            continue
        depth = 0
        if _is_code(tok):
            tags.append(B_CODE)
            depth, left = tok.count("(") - tok.count(")"), MAX_CALL_TOKENS
        elif _NUM.fullmatch(tok):
            tags.append(B_NUM)
        else:
            tags.append(O)
    return tags


def entity_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, "CODE"|"NUM") in `text` of each tagged span (B-CODE with its I-CODE tokens, B-NUM)."""
    spans = word_spans(text)
    tags = tag_tokens([text[a:b] for a, b in spans])
    out = []
    for k, tag in enumerate(tags):
        if tag in (B_CODE, B_NUM):
            end = k
            while tag == B_CODE and end + 1 < len(tags) and tags[end + 1] == I_CODE:
                end += 1
            out.append((spans[k][0], spans[end][1], "CODE" if tag == B_CODE else "NUM"))
    return out


# ------------------------------------------------------------------------------------------- the text


def _group(source: str) -> str:
    # The top-level package: its modules share vocabulary and sentences, so they stay in one split.
    # The language-reference topics are independent documents.
    return source if source.startswith("pydoc_data.") else source.split(".")[0]


def _clean(text: str) -> str:
    return " ".join(text.split())


def _is_sentence(s: str, lo: int, hi: int, min_alpha: float, capital: bool = True) -> bool:
    """A prose sentence of lo..hi words: not a doctest, mostly words (share >= min_alpha), starting with a
    capital letter or a quote unless `capital` is False (sentences may open with an identifier)."""
    words = s.split()
    if not lo <= len(words) <= hi or ">>>" in s or "::" in s:
        return False
    if capital and not (s[0].isupper() or s[0] in "`'\""):
        return False
    alpha = sum(w.strip(_LEAD + _TRAIL + ")]}").isalpha() for w in words)
    return alpha >= min_alpha * len(words)


def _documents() -> Iterator[tuple[str, str, str]]:
    for source, doc in iter_stdlib_docstrings():
        yield _group(source), source, doc


# ------------------------------------------------------------------------------ units for each task
# A "unit" is the material of one row; the rows are built once the splits are chosen.


def _sentence_slots(doc: str, seen: set[str]) -> list[str | None]:
    """The docstring's sentences in order; a sentence already used anywhere becomes None (gap kept, so
    "consecutive" stays literal)."""
    slots: list[str | None] = []
    for s in split_sentences(doc):
        s = _clean(s)
        slots.append(None if s in seen else s)
        seen.add(s)
    return slots


def _units(task: str, source: str, doc: str, seen: set[str], rng: random.Random) -> tuple[list, list[str]]:
    """(units, sentences usable as a negative sentence2) from one docstring."""
    if task in LM_TASKS or task == "seq2seq_lm":
        return _paragraph_units(task, doc, seen), []
    slots = _sentence_slots(doc, seen)
    units: list = []
    if task == "sequence_classification":
        ok = [s is not None and _is_sentence(s, 6, 40, 0.6) for s in slots]
        units = [(slots[i], slots[i + 1]) for i in range(len(slots) - 1) if ok[i] and ok[i + 1]]
        return units, [s for s, good in zip(slots, ok) if good]
    if task == "token_classification":
        for s in slots:
            if s is not None and _is_sentence(s, 5, 40, 0.4, capital=False):
                tokens = [s[a:b] for a, b in word_spans(s)]
                tags = tag_tokens(tokens)
                if len(tokens) <= 60:
                    units.append((tokens, tags))
        return units, []
    # question_answering: a sentence holding an identifier or a number, maybe with an entity-free
    # sentence before it (so answers are not always at the start) and the sentence after it; up to
    # three questions per context, as SQuAD asks several questions about one paragraph.
    for i, s in enumerate(slots):
        if s is None or not _is_sentence(s, 4, 40, 0.3, capital=False) or not entity_spans(s):
            continue
        parts = [s]
        prev = slots[i - 1] if i > 0 else None
        if prev is not None and _is_sentence(prev, 3, 40, 0.5) and not entity_spans(prev) and rng.random() < 0.5:
            parts.insert(0, prev)
        nxt = slots[i + 1] if i + 1 < len(slots) else None
        if nxt is not None and _is_sentence(nxt, 3, 40, 0.4) and rng.random() < 0.5:
            parts.append(nxt)
        context = " ".join(parts)
        spans = entity_spans(context)
        code = [(a, b) for a, b, kind in spans if kind == "CODE"]
        nums = [(a, b) for a, b, kind in spans if kind == "NUM"]
        if code:
            units.append((source, context, QUESTIONS[0], *code[0]))
            if context[slice(*code[-1])] != context[slice(*code[0])]:
                units.append((source, context, QUESTIONS[1], *code[-1]))
        if nums:
            units.append((source, context, QUESTIONS[2], *nums[0]))
    return units, []


def _paragraph_units(task: str, doc: str, seen: set[str]) -> list:
    paragraphs = []
    for para in re.split(r"\n\s*\n", doc):
        para = _clean(para)
        sentences = split_sentences(para)
        # Doctests and paragraphs sharing a sentence with text already used (inherited docstrings) go.
        if len(para.split()) < 8 or ">>>" in para or any(s in seen for s in sentences):
            continue
        seen.update(sentences)
        paragraphs.append(para)
    if task == "seq2seq_lm":
        units = []
        for para in paragraphs:
            words = para.split()
            if len(words) >= 12:
                units.append((" ".join(words[:64]), " ".join(words[:HEADLINE_WORDS])))
        return units
    out, budget = [], LM_MAX_WORDS
    for para in paragraphs:
        words = para.split()
        out.append(" ".join(words[:budget]))
        budget -= min(budget, len(words))
        if budget == 0:
            break
    text = "\n\n".join(out)
    return [text] if len(text.split()) >= 8 else []


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
        units, sentences = _units(task, source, doc, seen, rng)
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


# ------------------------------------------------------------------------------------------- writing


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
