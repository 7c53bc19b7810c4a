"""Today's families in the engine (issue 29): they train, and their parallel layouts train like one process.

Qwen3's per-head query/key norms are the new parallel-sensitive part: their weights are shared by every head,
and each tensor-parallel rank normalises its own heads, so their gradients must be summed over the TP group
(megatron-core's finalize_model_grads does it for `qk_layernorm` models; our HeadNorm leaves them unmarked for
sequence parallelism, whose scatter they never see). A tiny Qwen3 (GQA 4 heads / 2 groups, head dimension 24 !=
64 / 4, --init-layout-invariant) at TP2 with sequence parallelism: the same losses, gradient norms (1e-5) and
weights after 5 steps as on one process, in the scale-sensitive setting where a wrong gradient scale reaches the
weights. Multi-latent attention (DeepSeek-V2) at TP2, and with sequence parallelism. The slow lane adds Llama 3.x
(RoPE scaling) at TP2 x PP2, and Qwen3-MoE and DeepSeek-V2 at EP2 against EP1.
"""
import os

import pytest
import torch

from engine_utils import assert_trains_like, full_weights, run_engine, run_engines_in_one_process

QWEN3 = ["--model-family", "qwen3", "--num-query-groups", "2", "--kv-channels", "24", "--clip-grad", "0",
         "--adam-eps", "1", "--lr", "0.1"]
LLAMA3 = ["--model-family", "llama3", "--num-query-groups", "2", "--rope-scaling-low-freq-factor", "2",
          "--rope-scaling-original-max-position-embeddings", "16", "--max-position-embeddings", "64"]
# the DeepSeek-V2 shape with a query latent (its norm: LatentNorm), YaRN, a dense first layer, scaled routing
DEEPSEEK = ["--model-family", "deepseek_v2", "--model-size", "tiny", "--q-lora-rank", "24", "--num-layers", "2",
            "--hidden-size", "64", "--ffn-hidden-size", "96", "--moe-router-topk-scaling-factor", "1.5",
            "--moe-aux-loss-coeff", "0.01", "--clip-grad", "0", "--adam-eps", "1", "--lr", "0.1"]
MLA_DENSE = ["--model-family", "llama", "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", "24",
             "--kv-lora-rank", "32", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "24",
             "--rope-type", "yarn", "--rotary-scaling-factor", "4", "--original-max-position-embeddings", "16",
             "--mscale", "0.8", "--mscale-all-dim", "0.6", "--clip-grad", "0", "--adam-eps", "1", "--lr", "0.1"]
QWEN3_MOE = ["--model-family", "qwen3_moe", "--num-query-groups", "2", "--kv-channels", "24", "--num-experts", "4",
             "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--moe-aux-loss-coeff", "0.01"]


def _trains_like(reference, run, what: str) -> None:
    """test_engine_parallel's assert_trains_like on the model's weights, and the q/k/latent norms' updates (from an
    init of ones) compared relatively: their gradients are tiny, so one doubled over TP ranks stays under the
    weights' absolute tolerance."""
    (ref_lines, ref_ck), (lines, ck) = reference, run
    ref_w, w = (_model_weights(os.path.join(c, "iter_0000005")) for c in (ref_ck, ck))
    assert_trains_like((ref_lines, ref_w), lines, w)
    assert any("q_layernorm" in k for k in w) == ("qwen3" in what or "deepseek" in what)
    for k, ref in ref_w.items():
        if "self_attention." in k and "layernorm" in k:
            torch.testing.assert_close(w[k] - 1, ref - 1, rtol=1e-3, atol=1e-7,
                                       msg=lambda m, k=k: f"{what} {k} (update): {m}")


def _model_weights(checkpoint: str) -> dict:
    """The model's weights (an EP run's optimizer state is stored chained, under other names)."""
    return {k: v for k, v in full_weights(checkpoint).items() if "optimizer" not in k}


def _run(tmp_path, name: str, nproc: int, *args: str):
    ck = str(tmp_path / name / "ckpt")
    lines, _ = run_engine(tmp_path / name, nproc, *args, "--save", ck, torchrun=False)
    return lines, ck


# the single-process references of the default lane's tests, one after another in one process (CI time: one start-up)
REFERENCES = {"qwen3": QWEN3, "mla_dense": MLA_DENSE, "deepseek_v2": DEEPSEEK}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """name -> (metrics lines, --save root) of REFERENCES[name] on one process."""
    d = tmp_path_factory.mktemp("references")
    lines, _ = run_engines_in_one_process(d, {n: [*a, "--save", str(d / n / "ckpt")] for n, a in REFERENCES.items()})
    return {n: (lines[n], str(d / n / "ckpt")) for n in REFERENCES}


def test_qwen3_at_tp2_with_sequence_parallelism_trains_like_one_process(references, tmp_path):
    run = _run(tmp_path, "tp2_sp", 2, *QWEN3, "--tensor-model-parallel-size", "2", "--sequence-parallel")
    _trains_like(references["qwen3"], run, "qwen3 TP2 SP")


@pytest.mark.slow
def test_llama3_at_tp2_pp2_trains_like_one_process(tmp_path):
    reference = _run(tmp_path, "one", 1, *LLAMA3)
    run = _run(tmp_path, "tp2_pp2", 4, *LLAMA3, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
               "2")
    _trains_like(reference, run, "llama3 TP2 PP2")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_moe_families_at_ep2_train_like_ep1(family, tmp_path):
    model = QWEN3_MOE if family == "qwen3_moe" else DEEPSEEK
    reference = _run(tmp_path, "ep1", 2, *model)
    run = _run(tmp_path, "ep2", 2, *model, "--expert-model-parallel-size", "2")
    _trains_like(reference, run, f"{family} EP2")


@pytest.mark.parametrize("model,layout", [
    ("mla_dense", ["--tensor-model-parallel-size", "2"]),
    ("deepseek_v2", ["--tensor-model-parallel-size", "2", "--sequence-parallel"])],
    ids=["mla_dense_tp2", "deepseek_v2_tp2_sp"])
def test_multi_latent_attention_at_tp2_trains_like_one_process(model, layout, references, tmp_path):
    """Multi-latent attention's latent norms: each TP rank holds the whole latent (their gradients equal on every rank,
    not to be summed) or, with sequence parallelism, a slice of the sequence (to be summed). MoE needs sequence
    parallelism at TP > 1, so the first case is a dense model with DeepSeek's attention."""
    run = _run(tmp_path, "tp2", 2, *REFERENCES[model], *layout)
    _trains_like(references[model], run, "deepseek " + " ".join(layout))
