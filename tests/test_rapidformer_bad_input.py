"""`rapidformer` on bad input, as a user meets it: the real console script, its exit status and its words.

A data or model mistake is one `rapidformer: error:` line, exit status 2, no traceback, found by the launching
process before any worker starts (so with --nproc-per-node 2 it is printed once); a hub model name that is not
in the local cache fails at once (no network retries); flags that cannot act are refused, not ignored; and the
log says how long an iteration-based fine-tuning run is (the pretraining sample counts: tests/test_pretrainer.py).

Budgets (2 busy CPU cores): the data cases and the hub name never import torch (about 2-5 s each, the hub name
under 5 s asserted); the white-box PreTrainer refusal about 20 s (one worker: imports, datasets, the model); the
in-process checks under 1.5 s.
"""
from __future__ import annotations

import json
import os
import time

import pytest

from conftest import run_tool
from finetune_utils import ROOT, explain, minilm_dir, rapidformer, tiny_model

ROWS = [{"sentence": f"sentence number {i} is here", "label": i % 2} for i in range(20)]


def _jsonl(path, rows) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return tiny_model("bert", str(tmp_path_factory.mktemp("model") / "bert"))


def _one_error_line(proc) -> str:
    """The run failed with exit status 2 and printed exactly one line, `rapidformer: error: ...`."""
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode == 2, explain(proc)
    assert len(lines) == 1 and lines[0].startswith("rapidformer: error: "), explain(proc)
    return lines[0]


# ---- data problems: one line, exit 2, before any worker -----------------------------------------------------------
def _no_label(d):
    rows = [{"sentence": r["sentence"], "target": r["label"]} for r in ROWS]
    _jsonl(f"{d}/train.jsonl", rows)
    _jsonl(f"{d}/validation.jsonl", rows)


def _empty(d):
    _jsonl(f"{d}/validation.jsonl", ROWS)
    open(f"{d}/train.jsonl", "w").close()


def _latin1(d):
    _jsonl(f"{d}/train.jsonl", ROWS)
    _jsonl(f"{d}/validation.jsonl", ROWS)
    with open(f"{d}/validation.jsonl", "rb") as f:
        lines = f.read().split(b"\n")
    lines[12] = lines[12].replace(b"here", "caf\u00e9".encode("latin-1"))  # line 13: one byte 0xe9
    with open(f"{d}/validation.jsonl", "wb") as f:
        f.write(b"\n".join(lines))


def _bad_json(d):
    _jsonl(f"{d}/validation.jsonl", ROWS)
    _jsonl(f"{d}/train.jsonl", ROWS)
    with open(f"{d}/train.jsonl") as f:
        lines = f.read().split("\n")
    lines[6] = lines[6][:-1]  # line 7 loses its closing brace
    with open(f"{d}/train.jsonl", "w") as f:
        f.write("\n".join(lines))


def _glue(d):
    _jsonl(f"{d}/mrpc/train.jsonl", ROWS)
    _jsonl(f"{d}/mrpc/validation.jsonl", ROWS)


# case -> (make the data directory or None for no --data-path, extra flags, workers, words the line must hold)
CASES = {
    "missing_data_path": (None, [], 2, ["--task sequence_classification needs --data-path"]),
    "no_label_column": (_no_label, [], 1, ["train.jsonl:", "no label column", "columns found: ['sentence', 'target']",
                                           "--label-column"]),
    "empty_file": (_empty, [], 2, ["train.jsonl is empty (no rows)"]),
    "not_utf8": (_latin1, [], 1, ["validation.jsonl, line 13:", "not UTF-8", "b'\\xe9'"]),
    "json_syntax": (_bad_json, [], 2, ["train.jsonl, line 7:", "not valid JSON", "column 53"]),
    "wrong_data_name": (_glue, ["--data-name", "sst2"], 2, ["--data-name 'sst2'", "no subdirectory 'sst2'",
                                                            "(subdirectories: ['mrpc'])"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_data_problem_is_one_line_before_any_worker(model, tmp_path, case):
    make, extra, workers, words = CASES[case]
    data = []
    if make is not None:
        make(str(tmp_path / "data"))
        data = ["--data-path", str(tmp_path / "data")]
    start = time.perf_counter()
    proc = rapidformer("--task", "sequence_classification", "--pretrained-model-name-or-path", model, *data,
                       "--epochs", "1", "--save", str(tmp_path / "out"), "--nproc-per-node", str(workers), *extra,
                       timeout=300)
    line = _one_error_line(proc)
    for w in words:
        assert w in line, (w, line)
    if make is not None:
        assert str(tmp_path / "data") in line  # the file (or directory) is named in full
    # found before any worker: no model was loaded, nothing trained or saved
    assert not os.path.exists(tmp_path / "out"), line
    assert time.perf_counter() - start < 120


def test_hub_model_name_fails_at_once_offline(tmp_path):
    """A hub id that is not in the local cache: one line at once, not a minute of network retries."""
    env = {"HF_HUB_CACHE": str(tmp_path / "empty_cache"), "HF_HOME": str(tmp_path / "hf_home")}
    _jsonl(str(tmp_path / "data" / "train.jsonl"), ROWS)  # good data: only the model is wrong
    _jsonl(str(tmp_path / "data" / "validation.jsonl"), ROWS)
    start = time.perf_counter()
    proc = rapidformer("--task", "sequence_classification", "--pretrained-model-name-or-path", "bert-base-uncased",
                       "--data-path", str(tmp_path / "data"), "--nproc-per-node", "2", env=env, timeout=300)
    elapsed = time.perf_counter() - start
    line = _one_error_line(proc)
    for w in ("--pretrained-model-name-or-path bert-base-uncased", "not a local directory",
              "not in the local Hugging Face cache", str(tmp_path / "empty_cache"), "nothing is downloaded",
              "pass a local directory"):
        assert w in line, (w, line)
    assert elapsed < 5, f"{elapsed:.1f} s"


def test_hub_name_in_the_local_cache_is_accepted(tmp_path, monkeypatch):
    """The check reads the cache only: a name whose config.json is cached passes, another does not."""
    import huggingface_hub.constants as hc

    from megatron_patch.config.rapidformer_flags import UsageError, parse_args
    from megatron_patch.cli.preflight import check_model

    snapshot = tmp_path / "models--acme--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    check_model(parse_args(["--task", "masked_lm", "--pretrained-model-name-or-path", "acme/tiny"]))
    with pytest.raises(UsageError, match="acme/other: not a local directory and not in the local Hugging Face cache"):
        check_model(parse_args(["--task", "masked_lm", "--pretrained-model-name-or-path", "acme/other"]))
    with pytest.raises(UsageError, match="no config.json in that directory"):
        check_model(parse_args(["--task", "masked_lm", "--pretrained-model-name-or-path", str(tmp_path)]))


# ---- finetune_data: positions and names, in-process ----------------------------------------------------------------
def test_utf8_fault_line_is_counted_across_read_chunks(tmp_path, monkeypatch):
    from megatron_patch.data import split_files
    from megatron_patch.data.finetune_error import FinetuneDataError

    monkeypatch.setattr(split_files, "_READ_CHUNK", 64)  # many chunks, each extended to a line boundary
    rows = [json.dumps({"sentence": "x" * (i % 50), "label": 0}) for i in range(200)]
    raw = "\n".join(rows).encode()
    lines = raw.split(b"\n")
    lines[136] = lines[136][:5] + b"\xff" + lines[136][5:]
    (tmp_path / "train.jsonl").write_bytes(b"\n".join(lines))
    with pytest.raises(FinetuneDataError, match=r"train\.jsonl, line 137: bytes that are not UTF-8 \(b'\\xff' "
                                                r"at byte 6 of the line\)"):
        split_files.check_file(str(tmp_path / "train.jsonl"))


def test_json_document_and_csv_faults_name_the_file(tmp_path):
    from megatron_patch.data.finetune_data import load_finetune_dataset
    from megatron_patch.data.finetune_error import FinetuneDataError

    doc = tmp_path / "doc"
    doc.mkdir()
    (doc / "train.json").write_text('[\n  {"sentence": "a", "label": 0},\n  {"sentence": "b" "label": 1}\n]\n')
    _jsonl(str(doc / "validation.jsonl"), ROWS)
    with pytest.raises(FinetuneDataError, match=r"train\.json, line 3: not valid JSON \(Expecting ',' delimiter, "
                                                r"column 20\)"):
        load_finetune_dataset(str(doc))
    header = tmp_path / "header"
    header.mkdir()
    (header / "train.csv").write_text("sentence,label\n")
    _jsonl(str(header / "validation.jsonl"), ROWS)
    with pytest.raises(FinetuneDataError, match=r"train\.csv: a header but no rows"):
        load_finetune_dataset(str(header))
    (doc / "train.json").write_text("[]\n")
    with pytest.raises(FinetuneDataError, match=r"train\.json: no rows \(an empty JSON document\)"):
        load_finetune_dataset(str(doc))
    blank = tmp_path / "blank"
    _jsonl(str(blank / "validation.jsonl"), ROWS)
    (blank / "train.jsonl").write_text("\n\n  \n")
    with pytest.raises(FinetuneDataError, match=r"train\.jsonl holds only blank lines"):
        load_finetune_dataset(str(blank))


def test_a_split_without_a_column_of_the_train_split_names_its_file(tmp_path):
    from megatron_patch.data.finetune_data import load_finetune_dataset
    from megatron_patch.data.finetune_error import FinetuneDataError
    from megatron_patch.data.task_columns import find_task_columns

    _jsonl(str(tmp_path / "train.jsonl"), ROWS)
    _jsonl(str(tmp_path / "validation.jsonl"), [{"sentence": r["sentence"]} for r in ROWS])
    dd = load_finetune_dataset(str(tmp_path))
    with pytest.raises(FinetuneDataError) as e:
        find_task_columns("sequence_classification", dd, None, None)
    msg = str(e.value)
    for w in (str(tmp_path / "validation.jsonl"), "no 'label' column", "columns found: ['sentence']", "--label-column"):
        assert w in msg, (w, msg)
    with pytest.raises(FinetuneDataError, match=r"train\.jsonl: --label-column: column 'gold' does not exist; "
                                                r"columns found: \['sentence', 'label'\]"):
        find_task_columns("sequence_classification", dd, None, "gold")


# ---- flags that cannot act are refused ------------------------------------------------------------------------------
def test_shape_flags_must_match_the_model_directory_in_fine_tuning(model):
    from megatron_patch.config.rapidformer_flags import UsageError, parse_args
    from megatron_patch.cli.preflight import check_shapes

    def args(*flags):
        return parse_args(["--task", "sequence_classification", "--pretrained-model-name-or-path", model, *flags])

    check_shapes(args("--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128"))  # the tiny BERT's
    with pytest.raises(UsageError) as e:
        check_shapes(args("--num-layers", "12", "--hidden-size", "64", "--max-position-embeddings", "512"))
    msg = str(e.value)
    assert msg.startswith("--num-layers 12 --max-position-embeddings 512: fine-tuning trains the model in"), msg
    assert "num_hidden_layers 2, max_position_embeddings 256" in msg and "drop them" in msg


@pytest.fixture(scope="module")
def sentences(tmp_path_factory, texts) -> str:
    """A small BERT sentence corpus (MiniLM vocabulary), made by tools/preprocess_data.py."""
    d = tmp_path_factory.mktemp("sentences")
    with open(d / "docs.jsonl", "w") as f:
        for t in texts[:80]:
            f.write(json.dumps({"text": t}) + "\n")
    run_tool("preprocess_data.py", "--input", str(d / "docs.jsonl"), "--output-prefix", str(d / "bert"),
             "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", os.path.join(minilm_dir(), "vocab.txt"),
             "--split-sentences")
    return str(d / "bert_text_sentence")


# the how-to's Hugging Face BERT PreTrainer sample, run by a script that first says what the worker sees of offline mode
OFFLINE_PROBE = """import os, runpy
import huggingface_hub.constants as hc
print(f"offline: HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE')} hub={hc.HF_HUB_OFFLINE}", flush=True)
runpy.run_path(SAMPLE, run_name="__main__")
"""


def test_white_box_pretrainer_refuses_shape_flags_its_model_ignores(model, sentences, tmp_path):
    """The how-to's BERT PreTrainer sample loads the directory with from_pretrained: --num-layers 12 would be
    ignored, so the run is refused in one line. The worker runs with the hub offline even where the user's
    environment said otherwise (the probe prints what it sees before the sample runs)."""
    script = tmp_path / "probe.py"
    sample = os.path.join(ROOT, "examples", "rapidformer_pretrain_huggingface_bert_trainer.py")
    script.write_text(OFFLINE_PROBE.replace("SAMPLE", repr(sample)))
    proc = rapidformer("--user-script", str(script), "--pretrained-model-name-or-path", model, "--num-layers", "12",
                       "--hidden-size", "64", "--micro-batch-size", "4", "--global-batch-size", "8", "--seq-length",
                       "32", "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
                       os.path.join(minilm_dir(), "vocab.txt"), "--data-path", sentences, "--split", "90,10",
                       "--train-iters", "1", "--nproc-per-node", "1", env={"HF_HUB_OFFLINE": "0"}, timeout=600)
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, explain(proc)
    assert err[-1].startswith("rapidformer: error: --num-layers 12: the model from "
                              "model_optimizer_lr_scheduler_provider() has num_hidden_layers 2 in its config"), err[-1]
    assert sum("rapidformer: error:" in ln for ln in err) == 1
    assert "offline: HF_HUB_OFFLINE=1 hub=True" in proc.stdout, explain(proc)
    assert "training: 1 iterations" not in proc.stdout


@pytest.mark.parametrize("train_iters, epochs, words", [
    (2, 1, "2 optimizer steps (--train-iters 2) = 0.4 epoch(s) of 5 steps"),  # not "1 epoch(s)"
    (12, 3, "12 optimizer steps (--train-iters 12) = 2.4 epoch(s) of 5 steps"),
    (None, 3, "3 epoch(s) of 5 steps = 15 optimizer steps"),
    (40, 3, "3 epoch(s) of 5 steps = 15 optimizer steps"),  # --epochs 3 ends first
])
def test_fine_tuning_log_says_how_long_in_the_runs_own_unit(train_iters, epochs, words):
    from megatron_patch.templates.finetuner import training_span

    assert training_span(train_iters, epochs, 5) == words


def test_help_describes_pretraining():
    proc = rapidformer("--help", timeout=60)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for w in ("Black-box pretraining: --task pretraining trains the Hugging Face model in",
              "masked LM + next-sentence prediction", "Megatron mmap corpus", "tools/preprocess_data.py",
              "pretraining: trains the model directory", "needs --pretrained-model-name-or-path, --data-path PREFIX, "
              "--tokenizer-type, --vocab-file and --train-iters", "PreTrainer subclass"):
        assert w in text, w
    assert "fine-tuning" in text.lower()
