"""The columns a fine-tuning task reads (`--task`), found in a loaded dataset by their usual names (GLUE's
`sentence1/sentence2`, CoNLL's `tokens/ner_tags`, SQuAD's `question/context/answers`, ...); `--text-columns`
and `--label-column` override. Errors name the file a split was read from, the columns found and the flag."""
from __future__ import annotations

from datasets import DatasetDict

from megatron_patch.data.finetune_data import split_source
from megatron_patch.data.finetune_error import FinetuneDataError

TASKS = ("sequence_classification", "token_classification", "question_answering", "masked_lm",
         "casual_lm", "causal_lm", "seq2seq_lm")
_PAIRS = (("sentence1", "sentence2"), ("question", "sentence"), ("question1", "question2"),
          ("premise", "hypothesis"), ("sentence_a", "sentence_b"))
_SINGLES = ("sentence", "text", "content", "review")
_LABELS = ("label", "labels")
_TOKENS = ("tokens", "words")
_TAGS = ("ner_tags", "tags", "labels", "pos_tags")
_LM_TEXT = ("text", "content", "sentence", "document")
_SEQ2SEQ = (("source", "target"), ("document", "summary"), ("article", "highlights"), ("input", "output"),
            ("text", "summary"), ("src", "tgt"))


def find_columns(task: str, column_names: list[str], text_columns: list[str] | None = None,
                 label_column: str | None = None, source: str | None = None) -> dict:
    """The columns a task reads, found by their usual names; `--text-columns/--label-column` override.

    Returns, by task:
      sequence_classification  {"text": [one or two names], "label": name}
      token_classification     {"tokens": name, "tags": name}      (text_columns[0] / label_column override)
      question_answering       {"question", "context", "answers"}  (text_columns = [question, context],
                                                                     label_column = answers)
      masked_lm, casual_lm, causal_lm  {"text": name}
      seq2seq_lm               {"source": name, "target": name}    (text_columns = [source] or [source, target],
                                                                     label_column = target)
    Raises FinetuneDataError naming the task, the columns present and the flags to pass (and `source`, the
    file the columns come from, when given).
    """
    if task not in TASKS:
        raise FinetuneDataError(f"--task {task!r} has no fine-tuning columns; choose one of {list(TASKS)}")
    cols = list(column_names)
    where = f"{source}: " if source else ""
    for name in text_columns or []:
        if name not in cols:
            raise FinetuneDataError(f"{where}--text-columns: column {name!r} does not exist; columns found: {cols}")
    if label_column is not None and label_column not in cols:
        raise FinetuneDataError(f"{where}--label-column: column {label_column!r} does not exist; columns found: "
                                f"{cols}")
    text = list(text_columns or [])

    def first(candidates, what: str, flag: str) -> str:
        for c in candidates:
            if c in cols:
                return c
        raise FinetuneDataError(f"{where}--task {task}: no {what} column; columns found: {cols} (looked for "
                                f"{list(candidates)}); name it with {flag}")

    def at_most(n: int, meaning: str) -> None:
        if len(text) > n:
            raise FinetuneDataError(f"--text-columns: --task {task} takes at most {n} ({meaning}), got {text}")

    if task == "sequence_classification":
        at_most(2, "one text column, or two for sentence pairs")
        if not text:
            text = next(([a, b] for a, b in _PAIRS if a in cols and b in cols), None) or \
                [first(_SINGLES, "text", "--text-columns")]
        return {"text": text, "label": label_column or first(_LABELS, "label", "--label-column")}
    if task == "token_classification":
        at_most(1, "the tokens column")
        tokens = text[0] if text else first(_TOKENS, "tokens", "--text-columns")
        return {"tokens": tokens, "tags": label_column or first(_TAGS, "tag", "--label-column")}
    if task == "question_answering":
        at_most(2, "question and context")
        question = text[0] if text else first(("question",), "question", "--text-columns")
        context = text[1] if len(text) > 1 else first(("context",), "context", "--text-columns")
        return {"question": question, "context": context,
                "answers": label_column or first(("answers",), "answers", "--label-column")}
    if task == "seq2seq_lm":
        at_most(2, "source and target")
        if len(text) == 2:
            if label_column is not None and label_column != text[1]:
                raise FinetuneDataError(f"--text-columns {text} already names the target; "
                                        f"--label-column {label_column!r} disagrees")
            return {"source": text[0], "target": text[1]}
        if text or label_column:
            source = text[0] if text else next((s for s, t in _SEQ2SEQ if s in cols), None)
            target = label_column or next((t for s, t in _SEQ2SEQ if s == source and t in cols), None)
            if source is None or target is None:
                raise FinetuneDataError(f"--task {task}: name both the source (--text-columns) and the target "
                                        f"(--label-column); columns available: {cols}")
            return {"source": source, "target": target}
        pair = next(((s, t) for s, t in _SEQ2SEQ if s in cols and t in cols), None)
        if pair is None:
            raise FinetuneDataError(
                f"--task {task}: no source/target columns among {cols} (looked for {list(_SEQ2SEQ)}); "
                f"name them with --text-columns SOURCE TARGET (or --text-columns SOURCE --label-column TARGET)")
        return {"source": pair[0], "target": pair[1]}
    # masked_lm, casual_lm (the parameter guide's spelling), causal_lm
    at_most(1, "the text column")
    return {"text": text[0] if text else first(_LM_TEXT, "text", "--text-columns")}


# the flag that names each column a task reads (find_columns' keys)
_FLAG_OF_ROLE = {"text": "--text-columns", "tokens": "--text-columns", "question": "--text-columns",
                 "context": "--text-columns", "source": "--text-columns", "label": "--label-column",
                 "tags": "--label-column", "answers": "--label-column", "target": "--label-column"}


def _present(ds, name: str) -> bool:
    """A column the split's file really has: datasets gives every split the columns of all the files it reads
    together, filling those a file lacks with nulls (a null count from the Arrow table, no data read)."""
    return name in ds.column_names and (len(ds) == 0 or ds.data.column(name).null_count < len(ds))


def find_task_columns(task: str, dataset_dict: DatasetDict, text_columns: list[str] | None = None,
                      label_column: str | None = None) -> dict:
    """`find_columns` on the train split of `load_finetune_dataset`, then every split checked to hold those
    columns; errors name the file a split was read from (`split_source`), the columns found and the flag.
    A sequence_classification test split without labels is left to the task (it is not evaluated)."""
    def found(ds) -> list[str]:
        return [c for c in ds.column_names if _present(ds, c)]

    columns = find_columns(task, found(dataset_dict["train"]), text_columns, label_column,
                           source=split_source(dataset_dict, "train"))
    for split, ds in dataset_dict.items():
        for role, value in columns.items():
            if split == "test" and role == "label" and task == "sequence_classification":
                continue
            for name in (value if isinstance(value, list) else [value]):
                if not _present(ds, name):
                    raise FinetuneDataError(
                        f"{split_source(dataset_dict, split)}: no {name!r} column ({role} for --task {task}, as in "
                        f"the train split); columns found: {found(ds)}. Rename the column, or name it with "
                        f"{_FLAG_OF_ROLE[role]} if every split has it" + ("; the test split is optional: remove its "
                                                                          "file" if split == "test" else ""))
    return columns
