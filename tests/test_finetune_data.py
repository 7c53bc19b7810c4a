"""The offline fine-tuning data layer: loading local layouts and the local cache (never the network),
finding task columns, label names, and the task datasets made from the stdlib's docstrings."""
from __future__ import annotations

import itertools
import json
import os
import re
import socket
from collections import Counter
from pathlib import Path

import datasets
import huggingface_hub.constants
import pytest
from datasets import ClassLabel, Dataset, DatasetDict, Features, List, Value

from megatron_patch.data.class_labels import encode_labels, label_names
from megatron_patch.data.finetune_data import load_finetune_dataset
from megatron_patch.data.finetune_error import FinetuneDataError
from megatron_patch.data.sentences import split_sentences
from megatron_patch.data.task_columns import find_columns
from megatron_patch.demo import task_corpora as tc
from megatron_patch.demo.task_files import write_task_dataset
from megatron_patch.demo.task_tags import TAG_NAMES, tag_tokens, word_spans
from megatron_patch.demo.task_units import LM_MAX_WORDS, QUESTIONS
from megatron_patch.demo.corpus import iter_stdlib_docstrings

SIZES = {"train": 100, "validation": 30, "test": 20}
SEED = 7


# --------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def offline_hf(tmp_path, monkeypatch):
    """An empty Hugging Face home in tmp_path and no network: any connection attempt is recorded and fails.

    datasets and huggingface_hub read their cache paths at import, so the module constants are patched
    as well as the environment."""
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(home / "datasets"))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access attempted in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    yield home
    assert not attempts, f"the code tried to reach the network: {attempts}"


@pytest.fixture(scope="module")
def rows():
    """{task: {split: rows}} for every task, built once."""
    return {task: tc.build_task_rows(task, SIZES["train"], SIZES["validation"], SIZES["test"], seed=SEED)
            for task in tc.TASKS if task != "casual_lm"}


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


PAIRS = [{"sentence1": f"first {i}", "sentence2": f"second {i}", "label": i % 2} for i in range(6)]


# ------------------------------------------------------------------------------------------ loading


@pytest.mark.parametrize("ext", ["jsonl", "json", "csv", "parquet"])
def test_load_split_files_each_format(tmp_path, ext):
    d = tmp_path / "data"
    d.mkdir()
    for split, n in (("train", 6), ("validation", 3), ("test", 2)):
        ds = Dataset.from_list(PAIRS[:n])
        path = str(d / f"{split}.{ext}")
        {"jsonl": ds.to_json, "json": ds.to_json, "csv": lambda p: ds.to_csv(p, index=False),
         "parquet": ds.to_parquet}[ext](path)
    dd = load_finetune_dataset(str(d))
    assert {k: len(v) for k, v in dd.items()} == {"train": 6, "validation": 3, "test": 2}
    assert dd["train"]["sentence2"] == [r["sentence2"] for r in PAIRS]
    assert dd["validation"]["label"] == [0, 1, 0]


@pytest.mark.parametrize("alias", ["dev", "valid", "val"])
def test_validation_aliases_and_optional_test(tmp_path, alias):
    write_jsonl(tmp_path / "train.jsonl", PAIRS)
    write_jsonl(tmp_path / f"{alias}.jsonl", PAIRS[:2])
    dd = load_finetune_dataset(str(tmp_path))
    assert sorted(dd) == ["train", "validation"]
    assert len(dd["validation"]) == 2


def test_mixed_formats_across_splits(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", PAIRS)
    Dataset.from_list(PAIRS[:2]).to_csv(str(tmp_path / "dev.csv"), index=False)
    dd = load_finetune_dataset(str(tmp_path))
    assert (len(dd["train"]), len(dd["validation"])) == (6, 2)


def test_data_name_subdir_data_dir_and_hub_shards(tmp_path):
    # glue/mrpc/train.jsonl: --data-path glue --data-name mrpc
    write_jsonl(tmp_path / "glue" / "mrpc" / "train.jsonl", PAIRS)
    write_jsonl(tmp_path / "glue" / "mrpc" / "validation.jsonl", PAIRS[:1])
    write_jsonl(tmp_path / "glue" / "train.jsonl", PAIRS[:4])  # a different dataset one level up
    write_jsonl(tmp_path / "glue" / "validation.jsonl", PAIRS[:4])
    assert len(load_finetune_dataset(str(tmp_path / "glue"), "mrpc")["validation"]) == 1
    # a --data-name that names nothing is refused, not ignored; the directory's own name selects itself
    with pytest.raises(FinetuneDataError, match=r"--data-name 'sst2': .* no subdirectory 'sst2' \(subdirectories: \['mrpc'\]"):
        load_finetune_dataset(str(tmp_path / "glue"), "sst2")
    assert len(load_finetune_dataset(str(tmp_path / "glue" / "mrpc"), "mrpc")["validation"]) == 1
    assert len(load_finetune_dataset(str(tmp_path / "glue"))["validation"]) == 4
    # --data-dir relative to --data-path
    assert len(load_finetune_dataset(str(tmp_path), None, "glue/mrpc")["train"]) == 6
    # --data-path is a name, --data-dir an existing directory
    assert len(load_finetune_dataset("not-here", "mrpc", str(tmp_path / "glue"))["validation"]) == 1
    # the hub's parquet layout: data/train-00000-of-00002.parquet ...
    for k in range(2):
        Dataset.from_list(PAIRS[3 * k:3 * k + 3]).to_parquet(str(tmp_path / "hub" / "data" / f"train-0000{k}-of-00002.parquet"))
    Dataset.from_list(PAIRS[:2]).to_parquet(str(tmp_path / "hub" / "data" / "validation-00000-of-00001.parquet"))
    dd = load_finetune_dataset(str(tmp_path / "hub"))
    assert sorted(dd["train"]["sentence1"]) == sorted(r["sentence1"] for r in PAIRS)


def test_save_to_disk_dir_and_its_data_name_subdir(tmp_path):
    feats = Features({"tokens": List(Value("string")), "ner_tags": List(ClassLabel(names=["O", "B-X"]))})
    dd = DatasetDict({
        "train": Dataset.from_dict({"tokens": [["a", "b"], ["c"]], "ner_tags": [[0, 1], [0]]}, features=feats),
        "dev": Dataset.from_dict({"tokens": [["d"]], "ner_tags": [[1]]}, features=feats),
    })
    dd.save_to_disk(str(tmp_path / "saved"))
    dd.save_to_disk(str(tmp_path / "corpus" / "conll"))
    for loaded in (load_finetune_dataset(str(tmp_path / "saved")),
                   load_finetune_dataset(str(tmp_path / "corpus"), "conll")):
        assert sorted(loaded) == ["train", "validation"]  # dev renamed
        assert loaded["validation"]["ner_tags"] == [[1]]
        assert label_names(loaded, "ner_tags") == ["O", "B-X"]
    Dataset.from_list(PAIRS).save_to_disk(str(tmp_path / "single"))
    with pytest.raises(FinetuneDataError, match="single saved Dataset without splits"):
        load_finetune_dataset(str(tmp_path / "single"))


def test_missing_train_names_directory_and_files(tmp_path):
    write_jsonl(tmp_path / "training_data.jsonl", PAIRS)
    write_jsonl(tmp_path / "validation.jsonl", PAIRS)
    with pytest.raises(FinetuneDataError) as e:
        load_finetune_dataset(str(tmp_path))
    msg = str(e.value)
    assert "no train split" in msg and str(tmp_path) in msg and "training_data.jsonl" in msg
    assert "--data-path" in msg
    with pytest.raises(FinetuneDataError, match="--data-name 'mrpc'.* no subdirectory 'mrpc'"):
        load_finetune_dataset(str(tmp_path), "mrpc")


def test_missing_validation_is_an_error_not_a_silent_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", PAIRS)
    write_jsonl(tmp_path / "test.jsonl", PAIRS)
    with pytest.raises(FinetuneDataError, match="no validation split") as e:
        load_finetune_dataset(str(tmp_path))
    assert "dev.jsonl" in str(e.value) and str(tmp_path) in str(e.value)


def test_ambiguous_and_wrong_paths(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", PAIRS)
    write_jsonl(tmp_path / "validation.jsonl", PAIRS)
    write_jsonl(tmp_path / "dev.jsonl", PAIRS)
    with pytest.raises(FinetuneDataError, match="more than one validation split file"):
        load_finetune_dataset(str(tmp_path))
    with pytest.raises(FinetuneDataError, match="--data-path .* is a file"):
        load_finetune_dataset(str(tmp_path / "train.jsonl"))
    with pytest.raises(FinetuneDataError, match="--data-dir 'nope'"):
        load_finetune_dataset(str(tmp_path), None, "nope")


def test_broken_file_names_the_file(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"text": "ok", "label": 0}\n{"text": broken\n')
    write_jsonl(tmp_path / "validation.jsonl", PAIRS)
    with pytest.raises(FinetuneDataError, match="train.jsonl"):
        load_finetune_dataset(str(tmp_path))


def test_uncached_name_is_a_clear_offline_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./glue directory either
    before = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE"))
    with pytest.raises(FinetuneDataError) as e:
        load_finetune_dataset("glue", "mrpc")
    # offline mode was forced for the call only
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE")) == before
    msg = str(e.value)
    for part in ("--data-path 'glue'", "--data-name 'mrpc'", "not a local directory", "local Hugging Face",
                 "cache", "offline", "train/validation/test .jsonl/.json/.csv/.parquet", "save_to_disk"):
        assert part in msg, (part, msg)


def test_name_in_local_datasets_cache_loads_offline(tmp_path, monkeypatch):
    # The datasets cache as a first, online-era load leaves it; then the source files go away.
    src = tmp_path / "tinymrpc"
    write_jsonl(src / "train.jsonl", PAIRS)
    write_jsonl(src / "validation.jsonl", PAIRS[:2])
    datasets.load_dataset(str(src))
    for f in src.iterdir():
        f.unlink()
    src.rmdir()
    monkeypatch.chdir(tmp_path / "hf_home")
    dd = load_finetune_dataset("tinymrpc")
    assert (len(dd["train"]), len(dd["validation"])) == (6, 2)


def test_name_in_local_hub_cache_loads_offline(offline_hf):
    repo = offline_hf / "hub" / "datasets--someorg--tiny"
    sha = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    files = repo / "snapshots" / sha / "mrpc"
    files.mkdir(parents=True)
    Dataset.from_list(PAIRS).to_parquet(str(files / "train-00000-of-00001.parquet"))
    Dataset.from_list(PAIRS[:3]).to_parquet(str(files / "validation-00000-of-00001.parquet"))
    dd = load_finetune_dataset("someorg/tiny", "mrpc")
    assert (len(dd["train"]), len(dd["validation"])) == (6, 3)


# -------------------------------------------------------------------------------------------- labels


def test_label_names_from_values_and_features(tmp_path):
    def dd(train, valid, feature=None):
        f = Features({"label": feature}) if feature else None
        return DatasetDict({"train": Dataset.from_dict({"label": train}, features=f),
                            "validation": Dataset.from_dict({"label": valid}, features=f)})

    assert label_names(dd(["pos", "neg", "pos"], ["neg"]), "label") == ["neg", "pos"]
    assert label_names(dd([10, 2, 1], [2]), "label") == ["1", "2", "10"]  # numeric order
    assert label_names(dd([0.5, 3.2], [1.0]), "label") is None  # regression
    assert label_names(dd([1, 0], [0], ClassLabel(names=["no", "yes"])), "label") == ["no", "yes"]
    tags = DatasetDict({"train": Dataset.from_dict({"tags": [["O", "B-X"], ["I-X"]]})})
    assert label_names(tags, "tags") == ["B-X", "I-X", "O"]
    with pytest.raises(FinetuneDataError, match="--label-column 'nope'"):
        label_names(tags, "nope")

    encoded, names = encode_labels(dd([10, 2, 1], [2]), "label")
    assert names == ["1", "2", "10"] and encoded["train"]["label"] == [2, 1, 0] and encoded["validation"]["label"] == [1]
    assert isinstance(encoded["train"].features["label"], ClassLabel)
    with pytest.raises(FinetuneDataError, match="'maybe'"):
        encode_labels(dd(["pos", "neg"], ["maybe"]), "label")


def test_label_names_json_makes_class_labels(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"tokens": ["a", "b"], "ner_tags": [0, 2], "label": 1}])
    write_jsonl(tmp_path / "validation.jsonl", [{"tokens": ["c"], "ner_tags": [1], "label": 0}])
    (tmp_path / "label_names.json").write_text(json.dumps({"ner_tags": ["O", "B-X", "I-X"], "label": ["no", "yes"]}))
    dd = load_finetune_dataset(str(tmp_path))
    assert label_names(dd, "ner_tags") == ["O", "B-X", "I-X"] and label_names(dd, "label") == ["no", "yes"]
    assert dd["train"]["ner_tags"] == [[0, 2]] and dd["validation"]["label"] == [0]
    (tmp_path / "label_names.json").write_text(json.dumps({"ner_tags": ["O", "B-X"]}))  # tag 2 out of range
    with pytest.raises(FinetuneDataError, match="label id 2 of column 'ner_tags'"):
        load_finetune_dataset(str(tmp_path))


# ------------------------------------------------------------------------------------------- columns


@pytest.mark.parametrize("task,columns,expected", [
    ("sequence_classification", ["idx", "sentence1", "sentence2", "label"], {"text": ["sentence1", "sentence2"], "label": "label"}),
    ("sequence_classification", ["question", "sentence", "label", "idx"], {"text": ["question", "sentence"], "label": "label"}),
    ("sequence_classification", ["premise", "hypothesis", "labels"], {"text": ["premise", "hypothesis"], "label": "labels"}),
    ("sequence_classification", ["question1", "question2", "label"], {"text": ["question1", "question2"], "label": "label"}),
    ("sequence_classification", ["sentence_a", "sentence_b", "label"], {"text": ["sentence_a", "sentence_b"], "label": "label"}),
    ("sequence_classification", ["sentence", "label", "idx"], {"text": ["sentence"], "label": "label"}),
    ("sequence_classification", ["review", "label"], {"text": ["review"], "label": "label"}),
    ("token_classification", ["id", "tokens", "pos_tags", "ner_tags"], {"tokens": "tokens", "tags": "ner_tags"}),
    ("token_classification", ["tokens", "tags"], {"tokens": "tokens", "tags": "tags"}),
    ("token_classification", ["tokens", "pos_tags"], {"tokens": "tokens", "tags": "pos_tags"}),
    ("question_answering", ["id", "title", "context", "question", "answers"],
     {"question": "question", "context": "context", "answers": "answers"}),
    ("masked_lm", ["text"], {"text": "text"}),
    ("casual_lm", ["document", "id"], {"text": "document"}),
    ("causal_lm", ["content"], {"text": "content"}),
    ("seq2seq_lm", ["source", "target"], {"source": "source", "target": "target"}),
    ("seq2seq_lm", ["id", "document", "summary"], {"source": "document", "target": "summary"}),
    ("seq2seq_lm", ["article", "highlights", "id"], {"source": "article", "target": "highlights"}),
    ("seq2seq_lm", ["src", "tgt"], {"source": "src", "target": "tgt"}),
])
def test_find_columns_by_usual_names(task, columns, expected):
    assert find_columns(task, columns) == expected


def test_find_columns_overrides():
    cols = ["a", "b", "y", "text", "label"]
    assert find_columns("sequence_classification", cols, ["a", "b"], "y") == {"text": ["a", "b"], "label": "y"}
    assert find_columns("sequence_classification", cols, ["a"]) == {"text": ["a"], "label": "label"}
    assert find_columns("token_classification", ["w", "t"], ["w"], "t") == {"tokens": "w", "tags": "t"}
    assert find_columns("question_answering", ["q", "c", "ans"], ["q", "c"], "ans") == \
        {"question": "q", "context": "c", "answers": "ans"}
    assert find_columns("causal_lm", cols, ["b"]) == {"text": "b"}
    assert find_columns("seq2seq_lm", cols, ["a", "b"]) == {"source": "a", "target": "b"}
    assert find_columns("seq2seq_lm", cols, ["a"], "b") == {"source": "a", "target": "b"}


def test_find_columns_errors_name_flags_and_columns():
    with pytest.raises(FinetuneDataError) as e:
        find_columns("sequence_classification", ["a", "label"], ["missing"])
    assert "--text-columns" in str(e.value) and "'missing'" in str(e.value) and "['a', 'label']" in str(e.value)
    with pytest.raises(FinetuneDataError) as e:
        find_columns("sequence_classification", ["text", "label"], None, "gold")
    assert "--label-column" in str(e.value) and "'gold'" in str(e.value) and "['text', 'label']" in str(e.value)
    with pytest.raises(FinetuneDataError) as e:
        find_columns("sequence_classification", ["body", "label"])
    assert "sequence_classification" in str(e.value) and "['body', 'label']" in str(e.value) and "--text-columns" in str(e.value)
    with pytest.raises(FinetuneDataError, match="--label-column"):
        find_columns("sequence_classification", ["text", "gold"])
    with pytest.raises(FinetuneDataError, match="token_classification.*--label-column"):
        find_columns("token_classification", ["tokens", "stuff"])
    with pytest.raises(FinetuneDataError, match="question_answering.*context"):
        find_columns("question_answering", ["question", "answers"])
    with pytest.raises(FinetuneDataError, match="seq2seq_lm.*--text-columns SOURCE TARGET"):
        find_columns("seq2seq_lm", ["x", "y"])
    with pytest.raises(FinetuneDataError, match="at most 2"):
        find_columns("sequence_classification", ["a", "b", "c"], ["a", "b", "c"])
    with pytest.raises(FinetuneDataError, match="--task 'pretraining'"):
        find_columns("pretraining", ["text"])


# ------------------------------------------------------------------------------------- task corpora


def sentences_of(task: str, row: dict) -> list[str]:
    """The docstring sentences a row is made of (tokens rejoined for token classification)."""
    if task == "sequence_classification":
        return [row["sentence1"], row["sentence2"]]
    if task == "token_classification":
        return [" ".join(row["tokens"])]
    text = row.get("context") or row.get("source") or row.get("text")
    return split_sentences(text)


@pytest.mark.parametrize("task", [t for t in tc.TASKS if t != "casual_lm"])
def test_corpus_sizes_and_disjoint_splits(rows, task):
    got = rows[task]
    assert {k: len(v) for k, v in got.items()} == SIZES
    per_split = {split: {s for r in split_rows for s in sentences_of(task, r)} for split, split_rows in got.items()}
    for a in per_split:
        for b in per_split:
            if a < b:
                assert not per_split[a] & per_split[b], (task, a, b, sorted(per_split[a] & per_split[b])[:3])
    if task == "question_answering":  # whole packages go to one split
        packages = {split: {r["title"].split(".")[0] for r in split_rows} for split, split_rows in got.items()}
        assert not packages["train"] & packages["validation"] and not packages["train"] & packages["test"]


@pytest.mark.parametrize("task", ["sequence_classification", "causal_lm"])  # sentence and paragraph units
def test_repeated_text_never_crosses_splits(monkeypatch, task):
    # The stdlib repeats docstrings (inherited methods, copied helpers) across packages; simulate that
    # heavily: every docstring appears under three different packages.
    docs = list(itertools.islice(tc._documents(), 200))
    copies = [(f"copy{k}_{g}", f"copy{k}_{source}", doc) for g, source, doc in docs for k in range(3)]
    monkeypatch.setattr(tc, "_documents", lambda: iter(copies))
    got = tc.build_task_rows(task, 30, 10, 10, seed=1)
    per_split = {split: {s for r in split_rows for s in sentences_of(task, r)} for split, split_rows in got.items()}
    assert not per_split["train"] & per_split["validation"] and not per_split["train"] & per_split["test"]
    assert not per_split["validation"] & per_split["test"]


def test_corpus_is_deterministic_for_a_seed(tmp_path):
    a = write_task_dataset("sequence_classification", str(tmp_path / "a"), 40, 10, 5, seed=3)
    b = write_task_dataset("sequence_classification", str(tmp_path / "b"), 40, 10, 5, seed=3)
    c = write_task_dataset("sequence_classification", str(tmp_path / "c"), 40, 10, 5, seed=4)
    for name in ("train.jsonl", "validation.jsonl", "test.jsonl", "label_names.json"):
        assert (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes()
    assert (Path(a) / "train.jsonl").read_bytes() != (Path(c) / "train.jsonl").read_bytes()
    assert tc.build_task_rows("causal_lm", 20, 5, seed=3) == tc.build_task_rows("casual_lm", 20, 5, seed=3)


def test_sequence_classification_labels_balanced_and_true(rows):
    got = rows["sequence_classification"]
    for split, split_rows in got.items():
        assert Counter(r["label"] for r in split_rows) == {1: (len(split_rows) + 1) // 2, 0: len(split_rows) // 2}
        assert [r["idx"] for r in split_rows] == list(range(len(split_rows)))
        for r in split_rows:
            for s in (r["sentence1"], r["sentence2"]):
                assert 6 <= len(s.split()) <= 40 and s == " ".join(s.split())
    # label 1 <=> sentence2 follows sentence1 in one docstring: check against the corpus itself
    wanted = {s for split_rows in got.values() for r in split_rows for s in (r["sentence1"], r["sentence2"])}
    consecutive, seen = set(), set()
    for _, doc in iter_stdlib_docstrings():
        sents = [" ".join(s.split()) for s in split_sentences(doc)]
        consecutive.update(zip(sents, sents[1:]))
        seen.update(sents)
        if wanted <= seen:
            break
    assert wanted <= seen
    for split_rows in got.values():
        for r in split_rows:
            assert ((r["sentence1"], r["sentence2"]) in consecutive) == (r["label"] == 1), r


def test_token_classification_bio_tags(rows):
    names = TAG_NAMES
    for split_rows in rows["token_classification"].values():
        tagged = 0
        for r in split_rows:
            assert len(r["tokens"]) == len(r["ner_tags"]) and 5 <= len(r["tokens"])
            prev = "O"
            for tok, tag in zip(r["tokens"], r["ner_tags"]):
                name = names[tag]
                if name.startswith("I-"):  # BIO: I-X only continues a B-X/I-X
                    assert prev in ("B-" + name[2:], name), r
                if name == "B-NUM":
                    assert re.search(r"\d", tok), tok
                prev = name
            tagged += any(r["ner_tags"])
        assert tagged * 3 >= 2 * len(split_rows)
    text = "Use os.path.join() or f(a, b) with 42 max_size items, e.g. here."
    tokens = [text[a:b] for a, b in word_spans(text)]
    assert tokens == ["Use", "os.path.join()", "or", "f(a", ",", "b", ")", "with", "42", "max_size", "items", ",",
                      "e.g", ".", "here", "."]
    assert [names[t] for t in tag_tokens(tokens)] == \
        ["O", "B-CODE", "O", "B-CODE", "I-CODE", "I-CODE", "I-CODE", "O", "B-NUM", "B-CODE", "O", "O", "O", "O", "O", "O"]
    assert [(s, e) for s, e in word_spans("Call (see `os.path`), then f(x).")] == \
        [(0, 4), (5, 6), (6, 9), (10, 11), (11, 18), (18, 19), (19, 20), (20, 21), (22, 26), (27, 31), (31, 32)]


def test_question_answering_spans_exact(rows):
    for split_rows in rows["question_answering"].values():
        assert len({r["id"] for r in split_rows}) == len(split_rows)
        for r in split_rows:
            (text,), (start,) = r["answers"]["text"], r["answers"]["answer_start"]
            ctx = r["context"]
            assert text and ctx[start:start + len(text)] == text, r
            # the answer is a whole token: nothing word-like glued on either side
            assert start == 0 or not (ctx[start - 1].isalnum() or ctx[start - 1] in "_."), r
            assert start + len(text) == len(ctx) or not (ctx[start + len(text)].isalnum() or ctx[start + len(text)] == "_"), r
            assert r["question"] in QUESTIONS
            if "number" in r["question"]:
                assert re.fullmatch(r"[-+]?[0-9][0-9a-fA-FxXoObB_.eE+-]*", text), r
            else:
                assert re.search(r"[_.()]|[a-z][A-Z]|[A-Z]{2}[a-z]", text), r
                if r["question"].endswith("first?"):  # no identifier-looking token before the answer
                    assert not any(re.search(r"_|\(\)", w) for w in ctx[:start].split()), r


def test_lm_and_seq2seq_rows(rows):
    for task in ("masked_lm", "causal_lm"):
        for split_rows in rows[task].values():
            for r in split_rows:
                assert 8 <= len(r["text"].split()) <= LM_MAX_WORDS and ">>>" not in r["text"]
    for split_rows in rows["seq2seq_lm"].values():
        for r in split_rows:
            words = r["source"].split()
            assert 12 <= len(words) <= 64 and r["target"] == " ".join(words[:8])


def test_written_files_load_back_with_label_names(tmp_path):
    out = tmp_path / "tok"
    write_task_dataset("token_classification", str(out), 20, 5, 0, fmt="jsonl")
    write_task_dataset("token_classification", str(out), 20, 5, 4, fmt="parquet")  # replaces the jsonl files
    assert sorted(os.listdir(out)) == ["label_names.json", "test.parquet", "train.parquet", "validation.parquet"]
    dd = load_finetune_dataset(str(out))
    cols = find_columns("token_classification", dd["train"].column_names)
    assert label_names(dd, cols["tags"]) == TAG_NAMES
    assert {k: len(v) for k, v in dd.items()} == {"train": 20, "validation": 5, "test": 4}

    out = tmp_path / "mrpc"
    write_task_dataset("sequence_classification", str(out), 20, 6, fmt="csv")
    dd = load_finetune_dataset(str(out))
    assert label_names(dd, "label") == tc.CLASS_NAMES and sorted(dd) == ["train", "validation"]
    assert sorted(Counter(dd["validation"]["label"]).items()) == [(0, 3), (1, 3)]
    with pytest.raises(ValueError, match="CSV"):
        write_task_dataset("question_answering", str(tmp_path / "qa"), 5, 5, fmt="csv")


def test_too_few_examples_is_an_error(monkeypatch):
    docs = list(itertools.islice(tc._documents(), 40))  # a short corpus, so the error comes quickly
    monkeypatch.setattr(tc, "_documents", lambda: iter(docs))
    with pytest.raises(ValueError, match=r"too few question_answering examples .*'validation': '\d+/100000'"):
        tc.build_task_rows("question_answering", 10, 10 ** 5)


def test_make_finetune_data_tool(tmp_path):
    from conftest import run_tool

    proc = run_tool("make_finetune_data.py", "--task", "sequence_classification", "--output-dir", str(tmp_path),
                    "--train-samples", "30", "--valid-samples", "10", "--test-samples", "6", "--seed", "5")
    assert "train.jsonl" in proc.stdout and "label_names.json" in proc.stdout
    assert "train: 30 rows (not_consecutive=15, consecutive=15)" in proc.stdout
    assert sorted(os.listdir(tmp_path)) == ["label_names.json", "test.jsonl", "train.jsonl", "validation.jsonl"]


@pytest.mark.slow
@pytest.mark.parametrize("task", ["causal_lm"])  # the slowest: one row per docstring
def test_generation_speed(task):
    import time

    start = time.process_time()  # CPU time: wall time on a shared 2-core machine says little
    tc.build_task_rows(task, 2000, 200, 200)
    assert time.process_time() - start < 5.0
