"""Mixture-of-experts conversion: Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V2 <-> the engine, in expert-parallel
layouts.

Models (tests/conversion_utils.py MOE_FAMILIES): tiny transformers models with random weights, 4 experts top-2,
vocabulary 1001; qwen2_moe has a sparse and a dense layer, a gated shared expert and norm_topk_prob False.
Their routers have larger weights (std 0.25, router logits of std ~2), so that the top-2 choice has wide
margins (asserted below: >= 1e-3 between the 2nd and 3rd logit of every token): two correct implementations
differ in the last bits (~1e-6), which cannot flip an expert. verify's criterion is the other families':
max |logit difference| <= 1e-4 in fp32 and the same top-1 token.

1. In-process (fast): the tables use every tensor save_pretrained writes, and what they build computes
   transformers' experts (routed and shared) the way megatron-core's MLP uses it; config.json <-> engine fields
   (routing options, dense/sparse layers, shared expert); megatron-core's router with the chosen options
   picks transformers' experts with transformers' weights; --moe-layer-freq lists; presets validate.
2. The CLI (torchrun workers): hf2mcore --verify at EP 2 (and TP2 x EP2, TP2 x EP2 x ETP1, PP2 x EP2, EP1),
   mcore2hf back, every tensor bit for bit (`make test-all`; the default lane has qwen3_moe at TP2 and deepseek_v2
   at TP2 x EP2 x ETP1 in test_conversion_today).
3. Planted bugs (slow): Mixtral's w1/w3 swapped on import, and EP ranks given each other's experts, fail
   --verify; experts numbered per EP rank (the EP offset forgotten) are refused by the coverage check.
4. The presets' tiny models train (slow) and their checkpoints export and verify.
"""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conversion_utils import (  # noqa: E402
    MOE_FAMILIES, VOCAB, assert_same_tensors, build_hf_model, explain, manifest, read_safetensors_dir, run_convert,
    save_hf_model,
)
from engine_utils import run_engine  # noqa: E402

from megatron_patch.config import Config, ConfigError, parse_args  # noqa: E402
from megatron_patch.conversion import tables  # noqa: E402
from megatron_patch.conversion.mapping import ConversionError, check_coverage  # noqa: E402

# name -> (TP, PP, EP, ETP or None for TP)
LAYOUTS = {"ep1": (1, 1, 1, None), "ep2": (1, 1, 2, None), "tp2_ep2": (2, 1, 2, None),
           "tp2_ep2_etp1": (2, 1, 2, 1), "pp2_ep2": (1, 2, 2, None)}
# CI time: all in make test-all; the default lane converts this family's table at TP2 as Qwen3-MoE (experts over ETP 2)
# and its routed-expert rules (ROUTED) at TP2 x EP2 as DeepSeek-V2 (test_conversion_today), and checks Qwen2-MoE's
# shared expert and gate in-process (above)
FAST = set()


def layout_flags(layout: str):
    tp, pp, ep, etp = LAYOUTS[layout]
    return ["--target-tensor-model-parallel-size", str(tp), "--target-pipeline-model-parallel-size", str(pp),
            "--target-expert-model-parallel-size", str(ep),
            *(["--target-expert-tensor-parallel-size", str(etp)] if etp else []), "--make-vocab-size-divisible-by", "1"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """family -> a directory with its tiny model, saved once per module with save_pretrained."""
    root, done = tmp_path_factory.mktemp("hf_moe"), {}

    def get(family: str) -> str:
        if family not in done:
            done[family] = save_hf_model(family, str(root / family))
        return done[family]
    return get


def _config(family: str, **changes):
    import transformers

    fam = MOE_FAMILIES[family]
    return getattr(transformers, fam.config)(vocab_size=VOCAB, **{**fam.kwargs, **changes})


# ------------------------------------------------------------------------------------------ in-process

@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_tables_use_every_tensor_save_pretrained_writes(family, hf_dir):
    names = list(read_safetensors_dir(hf_dir(family)))
    module = tables.for_model_type(family)
    config = _config(family).to_dict()
    cfg = Config(**module.engine_args(config))
    rules = module.table.rules_for(cfg)
    check_coverage(module.table, rules, names, where=family)  # nothing missing, nothing left over
    experts = [r for r in rules if ".local_experts." in r.mcore]
    sparse = len(cfg.moe_layers())
    assert len(experts) == sparse * 4 * 2  # fc1 and fc2 of 4 experts per sparse layer
    assert {r.mcore for r in rules if r.mcore.endswith("router.weight")} == \
        {f"decoder.layers.{i}.mlp.router.weight" for i in cfg.moe_layers()}
    # transformers' in-memory names (experts fused into 3-D tensors) are not a checkpoint: refused in words
    fused = [k for k in build_hf_model(family).state_dict() if k.endswith("experts.gate_up_proj")]
    assert fused
    with pytest.raises(ConversionError, match="does not use"):
        check_coverage(module.table, rules, names + fused, where=family)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_expert_rules_compute_transformers_experts(family, hf_dir):
    """The tensors the table builds from the saved checkpoint, used as megatron-core's SwiGLU MLP uses them
    (linear_fc1 -> chunk into [gate; up] -> silu(gate) * up -> linear_fc2; the shared expert times
    sigmoid(x @ gate_weight.T)), compute what transformers' in-memory (fused) experts compute: a swapped w1/w3 or
    a misnumbered expert fails here, in milliseconds."""
    from megatron_patch.conversion.hf_io import HFCheckpointReader
    from megatron_patch.conversion.mapping import dims, to_mcore

    model = build_hf_model(family)
    module = tables.for_model_type(family)
    cfg = Config(**module.engine_args(model.config.to_dict()))
    rules = {r.mcore: r for r in module.table.rules_for(cfg)}
    read, d = HFCheckpointReader(hf_dir(family)).get, dims(cfg, VOCAB, VOCAB)
    first = cfg.moe_layers()[0]  # DeepSeek-V2's first layer is dense
    get = lambda name: to_mcore(rules[f"decoder.layers.{first}.mlp.{name}"], read, d)  # noqa: E731
    block = model.model.layers[first].mlp
    x = torch.randn(16, cfg.hidden_size, generator=torch.Generator().manual_seed(1))

    def swiglu(fc1, fc2, x):
        gate, up = (x @ fc1.t()).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ fc2.t()
    with torch.no_grad():
        for e in range(cfg.num_experts):
            gate, up = (x @ block.experts.gate_up_proj[e].t()).chunk(2, dim=-1)
            want = (torch.nn.functional.silu(gate) * up) @ block.experts.down_proj[e].t()
            got = swiglu(get(f"experts.local_experts.{e}.linear_fc1.weight"),
                         get(f"experts.local_experts.{e}.linear_fc2.weight"), x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"expert {e}")
        assert torch.equal(get("router.weight"), block.gate.weight)
        if family == "qwen2_moe":
            shared = swiglu(get("shared_experts.linear_fc1.weight"), get("shared_experts.linear_fc2.weight"), x)
            gated = torch.sigmoid(x @ get("shared_experts.gate_weight").t()) * shared
            want = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
            torch.testing.assert_close(gated, want, rtol=1e-5, atol=1e-6)
        if family == "deepseek_v2":  # shared experts without a gate
            shared = swiglu(get("shared_experts.linear_fc1.weight"), get("shared_experts.linear_fc2.weight"), x)
            torch.testing.assert_close(shared, block.shared_experts(x), rtol=1e-5, atol=1e-6)


def test_engine_fields_from_config_json():
    mixtral = tables.for_model_type("mixtral").engine_args(_config("mixtral").to_dict())
    assert mixtral["model_family"] == "mixtral" and mixtral["moe_router_pre_softmax"] is False
    assert (mixtral["num_experts"], mixtral["moe_router_topk"], mixtral["moe_ffn_hidden_size"]) == (4, 2, 96)
    assert mixtral["moe_layer_freq"] == 1 and not mixtral["moe_shared_expert_intermediate_size"]
    assert not mixtral["add_qkv_bias"] and mixtral["num_query_groups"] == 2

    qwen = tables.qwen2_moe.engine_args(_config("qwen2_moe").to_dict())
    assert qwen["moe_layer_freq"] == [1, 0]  # mlp_only_layers=[1]
    assert qwen["moe_router_pre_softmax"] is True  # norm_topk_prob False: the top-k probabilities as they are
    assert (qwen["ffn_hidden_size"], qwen["moe_ffn_hidden_size"], qwen["moe_shared_expert_intermediate_size"]) == \
        (96, 48, 80)
    assert qwen["moe_shared_expert_gate"] and qwen["add_qkv_bias"]
    renorm = tables.qwen2_moe.engine_args(_config("qwen2_moe", norm_topk_prob=True, mlp_only_layers=[],
                                                  decoder_sparse_step=2, num_hidden_layers=4).to_dict())
    assert renorm["moe_router_pre_softmax"] is False and renorm["moe_layer_freq"] == [0, 1, 0, 1]
    with pytest.raises(ConversionError, match="no layer has experts"):
        tables.qwen2_moe.engine_args(_config("qwen2_moe", mlp_only_layers=[0, 1]).to_dict())


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_config_json_of_an_engine_model_gives_the_same_model(family):
    """hf_config (an engine-native model's export) then engine_args: the same architecture."""
    from megatron_patch.config.model_source import ARCHITECTURE

    module = tables.for_model_type(family)
    args = module.engine_args(_config(family).to_dict())
    back = module.engine_args(module.hf_config(Config(**args), VOCAB, None))
    assert {k: back.get(k) for k in ARCHITECTURE} == {k: args.get(k) for k in ARCHITECTURE}
    assert tables.for_engine(Config(**args)) is module


@pytest.mark.parametrize("family,changes,pre_softmax", [
    ("mixtral", {}, False), ("qwen2_moe", {}, True), ("qwen2_moe", {"norm_topk_prob": True}, False),
    ("qwen3_moe", {}, False), ("qwen3_moe", {"norm_topk_prob": False}, True), ("deepseek_v2", {}, True),
    ("deepseek_v2", {"norm_topk_prob": True}, True)],  # DeepSeek-V2's router never renormalises
    ids=["mixtral", "qwen2_moe", "qwen2_moe_norm_topk", "qwen3_moe", "qwen3_moe_no_norm_topk", "deepseek_v2",
         "deepseek_v2_norm_topk_ignored"])
def test_megatron_router_picks_transformers_experts_and_weights(family, changes, pre_softmax):
    """transformers' router module and megatron-core's top-k with the options engine_args chooses: the same
    experts, the same weights (to 1e-6), on 4096 random tokens."""
    import importlib

    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    config = _config(family, **changes)
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    router = getattr(modeling, {"mixtral": "MixtralTopKRouter", "qwen3_moe": "Qwen3MoeTopKRouter",
                                "deepseek_v2": "DeepseekV2TopkRouter"}.get(family, "Qwen2MoeTopKRouter"))(config)
    args = tables.for_model_type(family).engine_args(config.to_dict())
    assert args["moe_router_pre_softmax"] is pre_softmax
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        hidden = torch.randn(4096, config.hidden_size, generator=g)
        logits, hf_weights, hf_experts = router(hidden)
        probs, experts = topk_routing_with_score_function(logits, args["moe_router_topk"], use_pre_softmax=pre_softmax,
                                                          scaling_factor=args.get("moe_router_topk_scaling_factor"),
                                                          dense_output=True)
    order_hf, order_mc = hf_experts.argsort(dim=1), experts.argsort(dim=1)
    assert torch.equal(hf_experts.gather(1, order_hf), experts.gather(1, order_mc))
    torch.testing.assert_close(probs.gather(1, order_mc), hf_weights.gather(1, order_hf), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_routing_margins_of_the_test_models_are_wide(family):
    """On verify's token batch, the k-th and (k+1)-th router logits of every token in every sparse layer are far
    apart compared with the ~1e-6 by which the two implementations' hidden states differ (softmax is monotonic:
    the logits' order is the experts' order)."""
    from megatron_patch.conversion.verify import sample_tokens

    model = build_hf_model(family)
    with torch.no_grad():
        out = model(input_ids=sample_tokens(VOCAB, 64), output_router_logits=True)
    k = model.config.num_experts_per_tok
    top = [layer.float().topk(k + 1, dim=-1).values for layer in out.router_logits]
    assert len(top) == (2 if family == "mixtral" else 1)  # qwen2_moe's second layer is dense
    smallest = min((v[:, k - 1] - v[:, k]).min().item() for v in top)
    assert smallest > 1e-3, smallest


def test_moe_layer_freq_accepts_megatron_lists_and_nothing_else():
    base = ["--mock-data", "--num-layers", "4", "--num-experts", "4", "--disable-bias-linear"]
    assert parse_args(base + ["--moe-layer-freq", "2"]).validate(1).moe_layers() == [0, 2]
    assert parse_args(base + ["--moe-layer-freq", "[0,1,1,1]"]).validate(1).moe_layers() == [1, 2, 3]
    assert parse_args(base + ["--moe-layer-freq", "([0]+[1])*2"]).validate(1).moe_layers() == [1, 3]
    with pytest.raises(ConfigError, match="neither N nor a list"):
        parse_args(base + ["--moe-layer-freq", "__import__('os').getcwd()"])
    with pytest.raises(ConfigError, match="one 0 .dense MLP. or 1 .experts. per layer, 4 of them"):
        parse_args(base + ["--moe-layer-freq", "[1,0]"]).validate(1)
    with pytest.raises(ConfigError, match="needs --moe-shared-expert-intermediate-size"):
        parse_args(base + ["--moe-shared-expert-gate"]).validate(1)


@pytest.mark.parametrize("family,size,world,flags", [
    ("mixtral", "tiny", 1, []), ("mixtral", "8x7b", 64, ["--expert-model-parallel-size", "8"]),
    ("mixtral", "8x22b", 64, ["--expert-model-parallel-size", "8", "--pipeline-model-parallel-size", "8"]),
    ("qwen2_moe", "tiny", 1, []), ("qwen2_moe", "a2.7b", 8, ["--expert-model-parallel-size", "4"]),
    ("qwen2_moe", "57b-a14b", 32, ["--expert-model-parallel-size", "8", "--tensor-model-parallel-size", "4",
                                   "--sequence-parallel"]),
    ("qwen3_moe", "tiny", 1, []), ("qwen3_moe", "30b-a3b", 16, ["--expert-model-parallel-size", "8"]),
    ("deepseek_v2", "tiny", 1, []), ("deepseek_v2", "lite", 16, ["--expert-model-parallel-size", "8"]),
])
def test_presets_validate(family, size, world, flags):
    c = parse_args(["--model-family", family, "--model-size", size, "--mock-data", *flags]).validate(world)
    dense = 1 if family == "deepseek_v2" else 0  # DeepSeek-V2's first layer (first_k_dense_replace)
    assert c.num_experts and c.moe_router_topk and c.moe_layers() == list(range(dense, c.num_layers))
    assert (c.moe_shared_expert_intermediate_size is not None) == (family in ("qwen2_moe", "deepseek_v2"))
    assert c.moe_shared_expert_gate == (family == "qwen2_moe")
    assert tables.for_engine(c) is tables.for_model_type(family)
    if size == "a2.7b":  # Qwen1.5-MoE-A2.7B
        assert (c.num_experts, c.moe_router_topk, c.moe_ffn_hidden_size, c.moe_shared_expert_intermediate_size,
                c.ffn_hidden_size, c.moe_router_pre_softmax) == (60, 4, 1408, 5632, 5632, True)


# --------------------------------------------------------------------------------------------- the CLI

MATRIX = [pytest.param(f, lay, id=f"{f}-{lay}", marks=() if (f, lay) in FAST else pytest.mark.slow)
          for f in MOE_FAMILIES for lay in LAYOUTS]


@pytest.mark.parametrize("family,layout", MATRIX)
def test_round_trip_verifies_and_reproduces_every_tensor(family, layout, hf_dir, tmp_path):
    """hf2mcore --verify in the layout (logits against transformers' there), mcore2hf back (with --verify at TP1
    EP1 in the slow cases), and the export holds every original tensor bit for bit."""
    src, ck, out = hf_dir(family), str(tmp_path / "ck"), str(tmp_path / "exported")
    proc = run_convert("--direction", "hf2mcore", "--load-dir", src, "--save-dir", ck, *layout_flags(layout), "--verify")
    assert proc.returncode == 0 and "verify passed" in proc.stdout, explain(proc)
    print(re.search(r"verify passed: max \|logit difference\| \S+", proc.stdout).group(0), f"({family} {layout})")
    assert os.listdir(tmp_path) == ["ck"], "hf2mcore left its staging directory or wrote elsewhere"
    tp, pp, ep, etp = LAYOUTS[layout]
    m = manifest(ck)
    assert (m["layout"]["tp"], m["layout"]["pp"], m["iteration"]) == (tp, pp, 0)
    assert m["layout"]["ep"] == ep and m["layout"]["etp"] == (etp or tp)
    assert m["config"]["save"] == ck  # the directory it was published as, not the staging one
    export_verify = ["--verify"] if (family, layout) not in FAST else ["--no-verify"]  # CI time: checked bit for bit
    proc = run_convert("--direction", "mcore2hf", "--load-dir", ck, "--save-dir", out, *export_verify)
    assert proc.returncode == 0 and ("verify passed" in proc.stdout or export_verify == ["--no-verify"]), explain(proc)
    assert_same_tensors(read_safetensors_dir(src), read_safetensors_dir(out), f"{family} {layout}: {out}")


PLANTED = [  # (plant, family, layout, exit status, what says so)
    ("import_gate_up_swapped", "mixtral", "ep1", 3, "verify FAILED"),  # Mixtral's w1 and w3 the wrong way round
    ("experts_swapped_across_ep", "qwen2_moe", "ep2", 3, "verify FAILED"),  # EP ranks given each other's experts
    # the EP offset forgotten: experts 2 and 3 are loaded nowhere, which the coverage check refuses before saving
    ("experts_local_numbering", "mixtral", "ep2", 2, "no parameter of the model took "
                                                     "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"),
]


@pytest.mark.slow
@pytest.mark.parametrize("plant,family,layout,status,message", PLANTED, ids=[p[0] for p in PLANTED])
def test_planted_expert_errors_are_caught(plant, family, layout, status, message, hf_dir, tmp_path):
    proc = run_convert("--direction", "hf2mcore", "--load-dir", hf_dir(family), "--save-dir", str(tmp_path / "ck"),
                       *layout_flags(layout), "--verify", plant=plant)
    assert proc.returncode == status and message in proc.stdout + proc.stderr, explain(proc)
    assert ("saved checkpoint" in proc.stdout) == (status == 3), explain(proc)  # verify reads what was written


# ------------------------------------------------------------------------------------------ the presets

@pytest.mark.slow
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_tiny_preset_trains_and_exports(family, tmp_path):
    """--model-family F --model-size tiny trains (loss falls over 6 iterations at EP 2) and its checkpoint
    exports as a transformers model that verify accepts."""
    lines, _ = run_engine(tmp_path / "run", 2, "--model-family", family, "--model-size", "tiny", "--mock-data",
                          "--vocab-size", "512", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size",
                          "4", "--train-iters", "6", "--lr", "3e-3", "--eval-iters", "0", "--log-interval", "1",
                          "--expert-model-parallel-size", "2", "--save", str(tmp_path / "ck"), base=[])
    losses = [x["loss"] for x in lines if "loss" in x]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    proc = run_convert("--direction", "mcore2hf", "--load-dir", str(tmp_path / "ck"), "--save-dir",
                       str(tmp_path / "hf"), "--verify")
    assert proc.returncode == 0 and "verify passed" in proc.stdout, explain(proc)
