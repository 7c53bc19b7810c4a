"""Helpers for the conversion tests: tiny Hugging Face models with random weights, the conversion CLI run
as a user runs it, an independent reading of safetensors directories, and planted bugs.

Planted bugs reach every process of a conversion (the CLI, torchrun and its workers) without touching
the package: `run_convert(..., plant=NAME)` puts a generated `sitecustomize.py` on PYTHONPATH, which
every Python process imports at start-up; it calls `apply_plant(NAME)`, which monkeypatches one
function of the package (see PLANTS). Nothing is planted unless a test asks for it.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
TOOL = os.path.join(ROOT, "tools", "convert_checkpoint.py")
VOCAB = 1001  # no TP size divides it: padded to 1001 (TP1) or 1002 (TP2) with --make-vocab-size-divisible-by 1


# ------------------------------------------------------------------------------------------ the models

@dataclass(frozen=True)
class Family:
    config: str  # transformers class names
    model: str
    kwargs: Dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    divisible_by: Optional[int] = 1  # --make-vocab-size-divisible-by (None: the default, 128)
    init: float = 0.05  # initializer_range
    router_std: Optional[float] = None  # MoE: std of the routers' weights (see build_hf_model)


FAMILIES = {
    # tied, gelu_new, learned positions, LayerNorm with biases, Conv1D weights
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel", dict(
        n_layer=2, n_embd=32, n_head=4, n_positions=64, activation_function="gelu_new", bos_token_id=0,
        eos_token_id=0), init=0.15),  # large enough that exact GELU for gelu_new moves logits by 1e-3
    # GQA (4 heads, 2 groups), untied, 4 layers; the default padding (1001 -> 1024)
    "llama": Family("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False), divisible_by=None),
    # QKV biases, tied embeddings, head_dim 16 != hidden 48 / 4 heads (the engine's --kv-channels)
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_hidden_layers=2, hidden_size=48, head_dim=16, intermediate_size=80, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)),
    # GQA, untied, sliding_window left at its default (4096, longer than any sequence here), bf16
    "mistral": Family("MistralConfig", "MistralForCausalLM", dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False), dtype=torch.bfloat16),
    # Llama 3.1-style RoPE scaling with non-default bounds (megatron-core hard-codes 1, 4, 8192: compat.rope), a base
    # of 500000, an original context shorter than the test's positions, GQA, untied
    "llama3": Family("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 2.0,
                         "high_freq_factor": 8.0, "original_max_position_embeddings": 64})),
    # q/k norms, head_dim 24 != hidden 64 / 4 heads, tied embeddings
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_hidden_layers=2, hidden_size=64, head_dim=24, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)),
}


# Mixture of experts: 4 experts, top-2, GQA, untied. qwen2_moe: a dense layer (mlp_only_layers) next to a sparse
# one, routed experts (48) narrower than the shared expert (80) and the dense MLP (96), norm_topk_prob False.
MOE_FAMILIES = {
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2), router_std=0.25),
    "qwen2_moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=80, mlp_only_layers=[1], norm_topk_prob=False), router_std=0.25),
    # Qwen3's attention (q/k norms, head_dim 24), no shared expert, norm_topk_prob True (the released models')
    "qwen3_moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=2, hidden_size=64, head_dim=24, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=True), router_std=0.25),
    # DeepSeek-V2 shape: multi-latent attention (queries from the hidden state, a 32-rank kv latent, 16 + 8 RoPE
    # query/key channels, 24 value channels), YaRN x4 over 32 positions with mscale/mscale_all_dim, the first layer
    # dense, 4 routed experts top 2 scaled by 1.5 and one shared expert
    "deepseek_v2": Family("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=128, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=24, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=48,
        first_k_dense_replace=1, routed_scaling_factor=1.5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.6}), router_std=0.25),
}


def build_hf_model(name: str, seed: int = 0):
    """The family's tiny model with random weights: transformers' initialization (std 0.05, GPT-2 0.15, so that
    attention is far from uniform and a wrong layout changes the logits by much more than verify's
    tolerance), then random norm weights (1 + N(0, 0.2)) and biases (N(0, 0.05)), so that no two
    tensors of a kind are equal (a mix-up of norms or biases changes the logits too)."""
    import transformers

    fam = FAMILIES.get(name) or MOE_FAMILIES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, fam.config)(vocab_size=VOCAB, initializer_range=fam.init, **fam.kwargs)
    model = getattr(transformers, fam.model)(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                is_norm_weight = pname.endswith("weight") and ("norm" in pname or ".ln_" in pname)
                p.copy_(1 + 0.2 * torch.randn_like(p) if is_norm_weight else 0.05 * torch.randn_like(p))
            elif fam.router_std and pname.endswith("mlp.gate.weight"):
                # Router logits of std ~2 (transformers' 0.05 gives ~0.4): the k-th and (k+1)-th logits of every
                # token are >= 7e-3 apart on verify's batch, thousands of times the last-bit differences between
                # two correct implementations, so no expert choice flips; the second expert keeps a weight of
                # ~0.25 on average, so a mistake in it still shows
                p.copy_(fam.router_std * torch.randn_like(p))
    return model.to(fam.dtype).eval()


def save_hf_model(name: str, path: str, seed: int = 0) -> str:
    build_hf_model(name, seed).save_pretrained(path)
    return path


def generate(model_dir: str, max_new_tokens: int = 5) -> torch.Tensor:
    """transformers' greedy continuation of a fixed prompt by the model in `model_dir` (export = original's?)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([[5, 17, 256, 999]])
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)


# -------------------------------------------------------------------------------------------- the CLI

LAYOUTS = {"tp1pp1": (1, 1), "tp2pp1": (2, 1), "tp1pp2": (1, 2), "tp2pp2": (2, 2)}


def layout_flags(layout: str):
    tp, pp = LAYOUTS[layout]
    return ["--target-tensor-model-parallel-size", str(tp), "--target-pipeline-model-parallel-size", str(pp)]


def padded_vocab(family: str, layout: str) -> int:
    """The embedding rows the engine must have: VOCAB rounded up to a multiple of lcm(divisible_by, TP)."""
    import math

    multiple = math.lcm(FAMILIES[family].divisible_by or 128, LAYOUTS[layout][0])
    return -(-VOCAB // multiple) * multiple


def vocab_flags(family: str):
    by = FAMILIES[family].divisible_by
    return [] if by is None else ["--make-vocab-size-divisible-by", str(by)]


def run_convert(*args: str, plant: Optional[str] = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python tools/convert_checkpoint.py ARGS` in a fresh interpreter, as a user types it (with `plant`,
    that bug is planted in every process it starts; CONVERSION_TESTS_PLANT=<name> in the environment
    plants one more in every conversion)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("CONVERSION_TEST_PLANT", None)
    # checking the tests: CONVERSION_TESTS_PLANT adds a bug to every conversion, next to the test's own
    plants = [p for p in (plant, os.environ.get("CONVERSION_TESTS_PLANT")) if p]
    if plants:
        assert all(p in PLANTS for p in plants), plants
        env["CONVERSION_TEST_PLANT"] = ",".join(plants)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_plant_dir(), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)


@contextlib.contextmanager
def planted_environment():
    """For runs these helpers do not start (tests/engine_utils.py::run_engine): with CONVERSION_TESTS_PLANT
    set, the processes started inside see the planted bug too; otherwise nothing changes."""
    plant = os.environ.get("CONVERSION_TESTS_PLANT")
    if not plant:
        yield
        return
    saved = {k: os.environ.get(k) for k in ("CONVERSION_TEST_PLANT", "PYTHONPATH")}
    os.environ["CONVERSION_TEST_PLANT"] = plant
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_plant_dir(), saved["PYTHONPATH"]]))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"


# ---------------------------------------------------------------------- safetensors, read independently

def read_safetensors_dir(path: str) -> Dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in `path` (safetensors' own loader; no index needed)."""
    from safetensors.torch import load_file

    out: Dict[str, torch.Tensor] = {}
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    assert files, f"no safetensors file in {path}: {os.listdir(path)}"
    for file in files:
        for name, tensor in load_file(file).items():
            assert name not in out, f"{name} is in two files of {path}"
            out[name] = tensor
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (so -0.0 differs from 0.0 and NaN payloads count)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensors(expected: Dict[str, torch.Tensor], got: Dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(expected), (f"{what}: names differ; missing {sorted(set(expected) - set(got))}, "
                                             f"extra {sorted(set(got) - set(expected))}")
    for name, want in expected.items():
        have = got[name]
        assert have.dtype == want.dtype, f"{what}: {name} is {have.dtype}, the original {want.dtype}"
        assert have.shape == want.shape, f"{what}: {name} has shape {tuple(have.shape)}, the original {tuple(want.shape)}"
        assert torch.equal(bits(have), bits(want)), (
            f"{what}: {name} differs from the original (max |diff| {(have.float() - want.float()).abs().max():.3e})")


def manifest(checkpoint_root: str) -> Dict:
    """checkpoint.json of the newest checkpoint under a --save root."""
    with open(os.path.join(checkpoint_root, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read().strip())
    with open(os.path.join(checkpoint_root, f"iter_{iteration:07d}", "checkpoint.json")) as f:
        return json.load(f)


def files_under(path: str):
    """Every file below `path` (relative paths), [] when it does not exist."""
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def assert_no_staging_dirs(parent: str) -> None:
    """No conversion left its staging directory (`.<name>.partial-*`, convert.publish) in `parent`."""
    left = [n for n in os.listdir(parent) if ".partial-" in n]
    assert not left, f"a conversion left its staging directory behind in {parent}: {left}"


# ------------------------------------------------------------------------------------------- planted bugs

def to_meta_rotary_layout(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The permutation transformers' convert_llama_weights_to_hf applies to q/k rows (Meta's interleaved
    rotary pairs -> Hugging Face's halves), here applied to rows already in Hugging Face's layout: what a
    converter that permutes twice (or not at all, in the other direction) produces."""
    dim1 = w.shape[0]
    tail = w.shape[1:]
    return w.reshape(n_heads, dim1 // n_heads // 2, 2, *tail).transpose(1, 2).reshape(dim1, *tail)


def _wrap(cls, method: str, make: Callable) -> None:
    original = getattr(cls, method)
    setattr(cls, method, make(original))


def _plant_swap_qk(T):
    def make(original):
        def to_mcore(self, hf, d):  # each group's key head swapped with its first query head
            t = original(self, hf, d)
            per_group = d.heads // d.groups * d.head_dim
            g = t.reshape(d.groups, per_group + 2 * d.head_dim, *t.shape[1:]).clone()
            q0, k = g[:, :d.head_dim].clone(), g[:, per_group:per_group + d.head_dim].clone()
            g[:, :d.head_dim], g[:, per_group:per_group + d.head_dim] = k, q0
            return g.reshape(t.shape)
        return to_mcore
    _wrap(T.FuseQKV, "to_mcore", make)


def _plant_rotary_interleaved(T):
    def make(original):
        def to_mcore(self, hf, d):
            q, k, v = hf
            return original(self, [to_meta_rotary_layout(q, d.heads), to_meta_rotary_layout(k, d.groups), v], d)
        return to_mcore
    _wrap(T.FuseQKV, "to_mcore", make)


def _plant_conv1d_square_untransposed(T):
    def make(original):
        def to_mcore(self, hf, d):  # a square Conv1D weight (attn.c_proj) kept as [in, out]
            (t,) = hf
            return t if t.dim() == 2 and t.shape[0] == t.shape[1] else original(self, hf, d)
        return to_mcore
    _wrap(T.Transpose, "to_mcore", make)


def _plant_export_keeps_padding(T):
    T.PadVocab.to_hf = lambda self, t, d: [t.contiguous()]


def _plant_export_no_transpose(T):
    T.Transpose.to_hf = lambda self, t, d: [t]


def _plant_export_gate_up_swapped(T):
    def make(original):
        return lambda self, t, d: original(self, t, d)[::-1]
    _wrap(T.FuseGateUp, "to_hf", make)


def _plant_export_k_v_swapped(T):
    def make(original):
        def to_hf(self, t, d):
            q, k, v = original(self, t, d)
            return [q, v, k]
        return to_hf
    _wrap(T.FuseQKV, "to_hf", make)


def _plant_export_fp32():
    from megatron_patch.conversion import convert

    convert.DTYPES["bf16"] = "float32"  # --dtype auto on a bf16 checkpoint writes fp32


def _plant_export_tied_lm_head():
    from megatron_patch.conversion import mapping

    def make(original):
        def to_hf(rules, read_mcore, d):
            for name, t in original(rules, read_mcore, d):
                yield name, t
                if name == "model.embed_tokens.weight" and not any(r.mcore == "output_layer.weight" for r in rules):
                    yield "lm_head.weight", t.clone()
        return to_hf
    mapping.to_hf = make(mapping.to_hf)
    from megatron_patch.conversion import convert  # noqa: F401  (convert imports to_hf inside mcore2hf: patched)


def _plant_verify_always_passes():
    from megatron_patch.conversion import verify

    verify.TOLERANCE = float("inf")
    original = verify.compare

    def compare(hf, engine, vocab):
        return {**original(hf, engine, vocab), "passed": True}
    verify.compare = compare


def _plant_no_save_dir_check():
    from megatron_patch.conversion import convert

    convert._check_save_dir = lambda path: None


def _plant_no_unused_tensor_check():
    from megatron_patch.conversion import mapping

    original = mapping.check_coverage

    def check_coverage(table, rules, hf_names, where):
        needed = {h for r in rules for h in r.hf}
        return original(table, rules, [n for n in hf_names if n in needed], where)
    mapping.check_coverage = check_coverage
    from megatron_patch.conversion import load_hf

    load_hf.check_coverage = check_coverage


def _plant_no_weights_only_note():
    from megatron_patch.training.checkpoint import checkpointer

    original = checkpointer._print0
    checkpointer._print0 = lambda msg: original(msg.replace("holds weights only", "holds weights"))


def _plant_verify_without_export_dtype():
    from megatron_patch.conversion import convert

    original = convert.run_workers

    def run_workers(nproc, task_args):  # verify the export against the checkpoint's weights, unrounded
        args = list(task_args)
        if "--dtype" in args:
            i = args.index("--dtype")
            del args[i:i + 2]
        return original(nproc, args)
    convert.run_workers = run_workers


def _plant_export_one_ulp(T):
    def make(original):
        def to_hf(self, t, d):  # one element one ulp off: invisible to the logits, not to a bitwise check
            gate, up = original(self, t, d)
            gate = gate.clone()
            gate.view(-1)[0] = torch.nextafter(gate.view(-1)[0], torch.tensor(float("inf"), dtype=gate.dtype))
            return [gate, up]
        return to_hf
    _wrap(T.FuseGateUp, "to_hf", make)


def _plant_export_config_no_architectures():
    from megatron_patch.conversion import convert

    original = convert.json.dump

    def dump(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and "architectures" in obj:
            obj = {k: v for k, v in obj.items() if k != "architectures"}
        return original(obj, f, *args, **kwargs)
    convert.json.dump = dump


def _plant_rope_scaling_ignored():
    from megatron_patch.conversion.tables import llama

    original = llama.rope_theta

    def rope_theta(c):  # rope_parameters read first: a rope_scaling next to a default one goes unseen
        params = c.get("rope_parameters") or {}
        return original({k: v for k, v in c.items() if k != "rope_scaling"}) if params else original(c)
    llama.rope_theta = rope_theta


def _plant_import_gate_up_swapped(T):
    def make(original):
        return lambda self, hf, d: original(self, hf[::-1], d)  # Mixtral's w1/w3 (gate/up) taken the wrong way round
    _wrap(T.FuseGateUp, "to_mcore", make)


def _plant_experts_local_numbering():
    """A loader that forgets the EP offset: every EP rank fills its local experts 0, 1, ... with the Hugging Face
    experts 0, 1, ... (right at EP 1, wrong for every rank but the first at EP > 1)."""
    import re

    from megatron_patch.conversion import load_hf

    original = load_hf.global_name

    def global_name(name, module):
        local = re.search(r"\.local_experts\.(\d+)\.", name)
        full = original(name, module)
        return re.sub(r"\.local_experts\.\d+\.", f".local_experts.{local.group(1)}.", full) if local else full
    load_hf.global_name = global_name


def _plant_experts_swapped_across_ep():
    """An import that hands each EP rank another rank's block of experts (rank r gets rank EP-1-r's): every expert
    is loaded somewhere, so no coverage check sees it; only in hf2mcore's own process, so --verify, which reads
    the written checkpoint back correctly, compares the wrong model with transformers'."""
    import re
    import sys

    from megatron_patch.conversion import load_hf

    original = load_hf.global_name

    def global_name(name, module):
        full = original(name, module)
        expert = re.search(r"\.local_experts\.(\d+)\.", full)
        if not expert or "hf2mcore" not in sys.argv:
            return full
        from megatron.core import parallel_state as mpu

        total = module.config.num_moe_experts
        local = total // mpu.get_expert_model_parallel_world_size()
        e = int(expert.group(1))
        swapped = total - local * (e // local + 1) + e % local
        return full.replace(expert.group(0), f".local_experts.{swapped}.")
    load_hf.global_name = global_name


def late_token(vocab: int, seq: int) -> int:
    """The token of verify's batch (conversion.verify.sample_tokens) that appears in its second row only, first
    as late as possible before the last position: corrupting its embedding row changes the logits at a few
    positions of one row only, which a verify that looks at the first position (or the first row) misses."""
    from megatron_patch.conversion.verify import sample_tokens

    tokens = sample_tokens(vocab, seq)
    first = {}
    for s, t in enumerate(tokens[1].tolist()):
        first.setdefault(t, s)
    only_second = [t for t in first if t not in set(tokens[0].tolist()) and first[t] < seq - 1]
    return max(only_second, key=lambda t: first[t])


def _plant_export_late_token_row():
    """An export whose input embedding row of late_token (at verify's 32 positions: the trained model of
    tests/test_conversion_export.py) is off by 1: only a few positions of one batch row see it."""
    from megatron_patch.conversion import mapping

    def make(original):
        def to_hf(rules, read_mcore, d):
            for name, t in original(rules, read_mcore, d):
                if name in ("model.embed_tokens.weight", "transformer.wte.weight"):
                    t = t.clone()
                    t[late_token(d.vocab, 32)] += 1.0
                yield name, t
        return to_hf
    mapping.to_hf = make(mapping.to_hf)


def _transforms(fn):
    def apply():
        from megatron_patch.conversion import transforms

        fn(transforms)
    return apply


PLANTS: Dict[str, Callable[[], None]] = {
    # errors a converter makes on import, which --verify must catch
    "swap_qk": _transforms(_plant_swap_qk),
    "rotary_interleaved": _transforms(_plant_rotary_interleaved),
    "conv1d_square_untransposed": _transforms(_plant_conv1d_square_untransposed),
    # bugs that the tests' own assertions must catch
    "export_keeps_padding": _transforms(_plant_export_keeps_padding),
    "export_no_transpose": _transforms(_plant_export_no_transpose),
    "export_gate_up_swapped": _transforms(_plant_export_gate_up_swapped),
    "export_k_v_swapped": _transforms(_plant_export_k_v_swapped),
    "export_fp32": _plant_export_fp32,
    "export_tied_lm_head": _plant_export_tied_lm_head,
    "export_one_ulp": _transforms(_plant_export_one_ulp),
    "export_config_no_architectures": _plant_export_config_no_architectures,
    "verify_without_export_dtype": _plant_verify_without_export_dtype,
    "export_late_token_row": _plant_export_late_token_row,
    "rope_scaling_ignored": _plant_rope_scaling_ignored,
    # mixture of experts (tests/test_conversion_moe.py)
    "import_gate_up_swapped": _transforms(_plant_import_gate_up_swapped),
    "experts_local_numbering": _plant_experts_local_numbering,
    "experts_swapped_across_ep": _plant_experts_swapped_across_ep,
    "verify_always_passes": _plant_verify_always_passes,
    "no_save_dir_check": _plant_no_save_dir_check,
    "no_unused_tensor_check": _plant_no_unused_tensor_check,
    "no_weights_only_note": _plant_no_weights_only_note,
}


def apply_plant(names: str) -> None:
    """Plant each bug of a comma-separated list."""
    for name in names.split(","):
        PLANTS[name]()


_SITECUSTOMIZE = f'''# generated by tests/conversion_utils.py: plants a bug in every process of a test conversion
import os, sys
if os.environ.get("CONVERSION_TEST_PLANT"):
    sys.path.append({TESTS!r})
    import conversion_utils
    sys.path.remove({TESTS!r})
    conversion_utils.apply_plant(os.environ["CONVERSION_TEST_PLANT"])
'''
_PLANT_DIR: Optional[str] = None


def _plant_dir() -> str:
    global _PLANT_DIR
    if _PLANT_DIR is None:
        _PLANT_DIR = tempfile.mkdtemp(prefix="conversion_plant_")
        with open(os.path.join(_PLANT_DIR, "sitecustomize.py"), "w") as f:
            f.write(_SITECUSTOMIZE)
    return _PLANT_DIR
