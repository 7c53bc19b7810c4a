"""`tools/convert_checkpoint.py` per model family and layout, run as a user runs it.

Families (tests/conversion_utils.py: tiny transformers models, random weights, vocabulary 1001, which no
TP size divides): gpt2 (tied, gelu_new, Conv1D), llama (GQA, untied, default padding to 1024), qwen2
(QKV biases, tied, head_dim != hidden/heads), mistral (GQA, untied, bf16, default sliding_window).

1. The matrix, 4 families x TP1PP1/TP2PP1/TP1PP2/TP2PP2: hf2mcore --verify and mcore2hf --verify pass;
   the export holds every original tensor bit for bit (same names, dtypes, bytes; a tied lm_head absent
   in both); its config loads with AutoConfig / AutoModelForCausalLM and generates what the original
   generates. All slow (`make test-all`) for CI time: the default lane has the round trips of today's families
   (test_conversion_today) and the --load-hf and round-trip tests (test_conversion_training).
2. Checkpoints the engine wrote while training (from a converted checkpoint with ZeRO-1 in another
   layout; from --load-hf with ZeRO-2) export and verify.
3. Errors a converter makes (swapped Q/K blocks, Meta's interleaved rotary layout, an untransposed square
   Conv1D), planted in the import's transforms, make --verify fail (exit 3) and leave nothing at --save-dir
   (fast: the Conv1D one). A converted checkpoint is published where asked and resumes under the --save rules.
4. Bad inputs give exit 2 and one message naming the file/tensor/flag and the fix, and write nothing.

`CONVERSION_TESTS_PLANT=<name> pytest ...` runs every conversion of these tests with a bug of
conversion_utils.PLANTS planted (how the tests were checked to fail on the bugs they guard).
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conversion_utils import (  # noqa: E402
    FAMILIES, LAYOUTS, VOCAB, assert_no_staging_dirs, assert_same_tensors, build_hf_model, explain, files_under, generate,
    layout_flags, manifest, padded_vocab, planted_environment, read_safetensors_dir, run_convert, save_hf_model, vocab_flags,
)
from engine_utils import run_engine  # noqa: E402

# All 16 run in make test-all (CI time). In the default lane instead: the tensor-exact round trips of today's families
# (test_conversion_today: Llama 3 at PP2, Qwen3-MoE at TP2, DeepSeek-V2 at TP2 x EP2), --load-hf of Llama at TP2 x PP2
# and GPT-2 at PP2 against HF's loss and the exported model's validation loss against HF's (test_conversion_training),
# the tables' every-tensor checks (below)
FAST = set()
MATRIX = [pytest.param(f, lay, id=f"{f}-{lay}", marks=() if (f, lay) in FAST else pytest.mark.slow)
          for f in FAMILIES for lay in LAYOUTS]
TIED = {f for f in FAMILIES if f in ("gpt2", "qwen2", "qwen3")}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """family -> a directory with its tiny model, saved once per module with save_pretrained."""
    root, done = tmp_path_factory.mktemp("hf_models"), {}

    def get(family: str) -> str:
        if family not in done:
            done[family] = save_hf_model(family, str(root / family))
        return done[family]
    return get


class Converted:
    """Engine checkpoints converted from hf_dir's models, by (family, layout): the matrix registers those it
    converted (with --verify); other tests reuse them or convert without --verify."""

    def __init__(self, root, hf_dir):
        self.root, self.hf_dir, self.done = root, hf_dir, {}

    def new_path(self, family: str, layout: str) -> str:
        return str(self.root / f"{family}-{layout}-{len(self.done)}")

    def register(self, family: str, layout: str, path: str) -> None:
        self.done[(family, layout)] = path

    def get(self, family: str, layout: str) -> str:
        if (family, layout) not in self.done:
            path = self.new_path(family, layout)
            proc = run_convert("--direction", "hf2mcore", "--load-dir", self.hf_dir(family), "--save-dir", path,
                               *layout_flags(layout), *vocab_flags(family))
            assert proc.returncode == 0, explain(proc)
            self.register(family, layout, path)
        return self.done[(family, layout)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, hf_dir):
    return Converted(tmp_path_factory.mktemp("converted"), hf_dir)


def assert_loads_and_generates(original: str, exported: str) -> None:
    """The exported config.json is the original model's (class, shapes, tie, dtype), and the exported
    model, loaded by transformers, generates exactly what the original generates."""
    from transformers import AutoConfig

    want, got = AutoConfig.from_pretrained(original), AutoConfig.from_pretrained(exported)
    assert type(got) is type(want) and got.architectures == want.architectures
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "n_inner", "tie_word_embeddings", "max_position_embeddings",
                "activation_function", "hidden_act", "rms_norm_eps", "layer_norm_epsilon", "dtype"):
        assert getattr(got, key, None) == getattr(want, key, None), f"{exported}/config.json: {key}"
    out = generate(exported)
    assert out.shape == (1, 9)
    assert torch.equal(out, generate(original)), "the export generates other tokens than the original"


# ----------------------------------------------------------------------------------------------- matrix

@pytest.mark.parametrize("family,layout", MATRIX)
def test_round_trip_verifies_and_reproduces_every_tensor(family, layout, hf_dir, converted, tmp_path):
    src = hf_dir(family)
    ck = converted.new_path(family, layout)
    proc = run_convert("--direction", "hf2mcore", "--load-dir", src, "--save-dir", ck, *layout_flags(layout),
                       *vocab_flags(family), "--verify")
    assert proc.returncode == 0 and "verify passed" in proc.stdout, explain(proc)
    converted.register(family, layout, ck)
    m = manifest(ck)
    tp, pp = LAYOUTS[layout]
    assert (m["layout"]["tp"], m["layout"]["pp"], m["iteration"]) == (tp, pp, 0)
    assert m["model"]["vocab_size"] == VOCAB and m["model"]["padded_vocab_size"] == padded_vocab(family, layout)
    assert m["model"]["hf_dtype"] == str(FAMILIES[family].dtype).replace("torch.", "")

    out = str(tmp_path / "exported")
    proc = run_convert("--direction", "mcore2hf", "--load-dir", ck, "--save-dir", out, "--verify")
    assert proc.returncode == 0 and "verify passed" in proc.stdout, explain(proc)
    original = read_safetensors_dir(src)
    exported = read_safetensors_dir(out)
    assert_same_tensors(original, exported, f"{family} {layout}: {out}")
    if family in TIED:
        assert "lm_head.weight" not in original and "lm_head.weight" not in exported
    assert_loads_and_generates(src, out)


# ------------------------------------------------------------------------------- checkpoints from training

TRAIN = ["--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4", "--seq-length", "32",
         "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1"]


def _export_and_check_trained(ck: str, original_dir: str, out: str, dtype: torch.dtype, rounded: bool) -> None:
    """mcore2hf --verify of a trained checkpoint; the export has the original's names and shapes, the dtype
    `dtype`, and other values (the training changed every matrix). `rounded`: the checkpoint holds fp32
    weights that the export rounds to `dtype` (verify compares what the export holds, and says so)."""
    proc = run_convert("--direction", "mcore2hf", "--load-dir", ck, "--save-dir", out, "--verify")
    assert proc.returncode == 0 and "verify passed" in proc.stdout, explain(proc)
    assert ("weights rounded to bfloat16" in proc.stdout) == rounded, explain(proc)
    original, exported = read_safetensors_dir(original_dir), read_safetensors_dir(out)
    assert sorted(exported) == sorted(original)
    for name, t in original.items():
        assert exported[name].shape == t.shape and exported[name].dtype == dtype, name
        if t.dim() == 2:
            assert not torch.equal(exported[name].to(t.dtype), t), f"{name}: training did not change it"
    generate(out)


@pytest.mark.slow
@pytest.mark.parametrize("precision", [["--bf16"], []], ids=["bf16", "fp32"])
def test_export_after_training_from_a_converted_checkpoint_zero1(precision, converted, hf_dir, tmp_path):
    """Converted at TP1 PP1 (bf16 mistral), trained 2 iterations at TP1 PP2 DP2 with ZeRO-1 (4 processes),
    in bf16 or in fp32: the engine says the checkpoint holds weights only and the optimizer starts fresh;
    the trained checkpoint exports in bf16 (the original's dtype) and verifies."""
    ck = converted.get("mistral", "tp1pp1")
    ck2 = str(tmp_path / "trained")
    with planted_environment():
        _, proc = run_engine(tmp_path / "run", 4, *TRAIN, "--pipeline-model-parallel-size", "2",
                             "--zero-1-memory-optimization", *precision, "--load", ck, "--save", ck2, base=[])
    assert "holds weights only" in proc.stdout and "optimizer, lr schedule and RNG start fresh" in proc.stdout, \
        proc.stdout[-3000:]
    m = manifest(ck2)
    assert m["iteration"] == 2 and m["layout"] == {"tp": 1, "pp": 2, "dp": 2, "vpp": 1, "zero": 1}
    _export_and_check_trained(ck2, hf_dir("mistral"), str(tmp_path / "exported"), torch.bfloat16,
                              rounded=not precision)


@pytest.mark.slow
@pytest.mark.parametrize("family,precision", [("qwen2", []), ("mistral", ["--bf16"])], ids=["qwen2-fp32", "mistral-bf16"])
def test_export_after_training_zero2(family, precision, hf_dir, tmp_path):
    """ZeRO-2 (Megatron-FSDP, fsdp_dtensor format) at TP2 DP2 from --load-hf (qwen2: tied, QKV biases,
    head_dim != hidden/heads; mistral in bf16, whose checkpoint holds the fp32 main weights): the trained
    checkpoint exports (bf16 for the bf16 run) and verifies. (A converted torch_dist checkpoint does not
    load into a ZeRO-2 run: --load-hf is the way in.)"""
    src = hf_dir(family)
    ck = str(tmp_path / "trained")
    with planted_environment():
        _, proc = run_engine(tmp_path / "run", 4, *TRAIN, "--tensor-model-parallel-size", "2",
                             "--zero-2-memory-optimization", *precision, "--make-vocab-size-divisible-by", "1",
                             "--load-hf", src, "--save", ck, base=[])
    assert f"from --load-hf {src}" in proc.stdout, proc.stdout[-3000:]
    m = manifest(ck)
    assert m["format"] == "fsdp_dtensor" and m["layout"]["zero"] == 2 and m["model"]["padded_vocab_size"] == 1002
    _export_and_check_trained(ck, src, str(tmp_path / "exported"), FAMILIES[family].dtype, rounded=bool(precision))


# ---------------------------------------------------------------------------------- planted import errors

PLANTED = [  # (plant, family, layout): each a mistake of a converter, made in the import's transform
    pytest.param("swap_qk", "llama", "tp2pp1", id="swapped_qk_blocks", marks=pytest.mark.slow),  # CI time
    pytest.param("rotary_interleaved", "mistral", "tp1pp1", id="meta_rotary_layout", marks=pytest.mark.slow),
    # the default lane's failing hf2mcore --verify (one worker: ~25 s), which also leaves nothing behind
    pytest.param("conv1d_square_untransposed", "gpt2", "tp1pp1", id="untransposed_conv1d"),
]


@pytest.mark.parametrize("plant,family,layout", PLANTED)
def test_planted_import_error_fails_verify(plant, family, layout, hf_dir, tmp_path):
    """The checkpoint is written (the error is silent there); --verify compares it with the original model
    and fails with exit 3; --debug shows the difference after every layer. Nothing is left: neither --save-dir
    nor the staging directory the checkpoint was written and verified in."""
    ck = tmp_path / "ck"
    proc = run_convert("--direction", "hf2mcore", "--load-dir", hf_dir(family), "--save-dir", str(ck),
                       *layout_flags(layout), *vocab_flags(family), "--verify", "--debug", plant=plant)
    assert "saved checkpoint" in proc.stdout, explain(proc)
    assert proc.returncode == 3 and "verify FAILED" in proc.stdout and "verify passed" not in proc.stdout, explain(proc)
    assert "layer   0: max |hidden difference|" in proc.stdout, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)  # one message that says what to do, not torchrun's
    assert "verification failed" in proc.stderr and "--debug" in proc.stderr, explain(proc)
    assert not ck.exists() and f"hf2mcore: nothing written to {ck} (it failed verification)" in proc.stdout, \
        explain(proc)
    assert_no_staging_dirs(str(tmp_path))


# ------------------------------------------------------------------------------------------ bad inputs

def _edited_copy(src: str, dst: str, config=None, tensors=None) -> str:
    """A copy of the model directory `src` with config.json updated by `config` (a None value removes the
    key) and the weights changed by `tensors(dict)` (in place)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            c = json.load(f)
        c.update(config)
        c = {k: v for k, v in c.items() if v is not None}  # None: remove the key
        with open(path, "w") as f:
            json.dump(c, f)
    if tensors:
        file = os.path.join(dst, "model.safetensors")
        state = load_file(file)
        tensors(state)
        save_file(state, file, metadata={"format": "pt"})
    return dst


def assert_refused(proc, *phrases: str, code: int = 2) -> None:
    """Exit `code`, one `conversion error:` message with every phrase in it, no traceback."""
    assert proc.returncode == code, explain(proc)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("conversion error:")]
    assert len(lines) == 1, explain(proc)
    for phrase in phrases:
        assert phrase in lines[0], f"{phrase!r} not in: {lines[0]}"
    assert "Traceback" not in proc.stderr, explain(proc)


def _extra_tensor(state):
    state["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(4, 4)


def _no_up_proj(state):
    del state["model.layers.1.mlp.up_proj.weight"]


BAD_INPUTS = [  # (id, config.json changes, tensor changes, phrases the message must have)
    # transformers 5 applies a rope_scaling next to a default rope_parameters (it wins)
    ("rope_scaling_linear", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     None, ["{src}: config.json rope type 'linear'", "encoded differently"]),
    # as transformers 4 saved it: rope_theta and rope_scaling {"type": ...}, no rope_parameters
    ("rope_scaling_linear_v4", {"rope_parameters": None, "rope_theta": 10000.0,
                                "rope_scaling": {"type": "linear", "factor": 2.0}},
     None, ["{src}: config.json rope type 'linear'", "encoded differently"]),
    ("llama_gelu", {"hidden_act": "gelu"}, None, ["{src}: config.json hidden_act 'gelu'", "silu"]),
    ("extra_tensor", None, _extra_tensor,
     ["{src} has 1 tensor(s) the llama table does not use", "model.layers.0.self_attn.extra_proj.weight",
      "converting would drop them", "check config.json"]),
    ("missing_tensor", None, _no_up_proj, ["{src} lacks 1 tensor(s)", "model.layers.1.mlp.up_proj.weight"]),
    # its message names the tensors and config.json, not the directory
    ("kv_heads_mismatch", {"num_key_value_heads": 4}, None,
     ["self_attn.k_proj.weight", "do not match config.json"]),
]


@pytest.mark.parametrize("case,config,tensors,phrases", [
    # CI time: all slow; the default lane guards the refusals in-process (test_conversion_tables: an unused or missing
    # tensor; test_conversion_today: every config.json field the engine cannot build) and the CLI's exit 2 with
    # nothing written through test_save_dir_not_empty_is_refused
    pytest.param(*c, id=c[0], marks=pytest.mark.slow) for c in BAD_INPUTS])
def test_bad_hugging_face_input_is_refused_in_words(case, config, tensors, phrases, hf_dir, tmp_path):
    src = _edited_copy(hf_dir("llama"), str(tmp_path / "bad"), config, tensors)
    save = str(tmp_path / "ck")
    proc = run_convert("--direction", "hf2mcore", "--load-dir", src, "--save-dir", save,
                       "--target-tensor-model-parallel-size", "2", "--verify")
    assert_refused(proc, *(p.format(src=src) for p in phrases))
    assert files_under(save) == [], "a refused conversion left files behind"
    assert_no_staging_dirs(str(tmp_path))


def test_save_dir_not_empty_is_refused(hf_dir, converted, tmp_path):
    for direction, load in (("hf2mcore", hf_dir("llama")), ("mcore2hf", converted.get("llama", "tp1pp1"))):
        save = tmp_path / direction
        save.mkdir()
        (save / "keep.txt").write_text("mine")
        proc = run_convert("--direction", direction, "--load-dir", load, "--save-dir", str(save))
        assert_refused(proc, f"--save-dir {save}", "not empty", "choose a new or empty directory")
        assert files_under(str(save)) == ["keep.txt"] and (save / "keep.txt").read_text() == "mine"


def test_converted_checkpoint_is_published_where_asked_and_resumes(converted, tmp_path):
    """hf2mcore writes into a staging directory and renames it: the checkpoint's stored configuration names
    --save-dir (not the staging directory), none is left next to it, and a run takes it as its own under the
    --save rules: --load DIR --save DIR and --load DIR --save OTHER are accepted (the architecture from the
    checkpoint), --save DIR without --load is refused. Budget: < 1 s (the conversion is shared with the
    test above)."""
    from megatron_patch.config import ConfigError, parse_args

    ck = converted.get("llama", "tp1pp1")
    assert manifest(ck)["config"]["save"] == ck
    assert sorted(os.listdir(ck)) == ["iter_0000000", "latest_checkpointed_iteration.txt"]
    assert_no_staging_dirs(os.path.dirname(ck))
    run = ["--mock-data", "--micro-batch-size", "1", "--train-iters", "2", "--eval-iters", "0", "--seq-length", "32"]
    for save in (ck, str(tmp_path / "continued")):
        cfg = parse_args([*run, "--load", ck, "--save", save]).validate(1)
        assert (cfg.num_layers, cfg.hidden_size, cfg.num_query_groups) == (4, 64, 2)
    with pytest.raises(ConfigError, match="already holds"):
        parse_args([*run, "--save", ck]).validate(1)


@pytest.mark.slow  # CI time: each refusal test starts the tool; the fast set keeps extra_tensor and save-dir
def test_model_family_mismatch_is_refused(hf_dir, converted, tmp_path):
    for direction, load, asked, found in (("hf2mcore", hf_dir("llama"), "gpt2", "llama"),
                                          ("mcore2hf", converted.get("llama", "tp2pp1"), "gpt2", "llama"),
                                          ("hf2mcore", hf_dir("llama"), "bert", "llama")):
        save = str(tmp_path / f"{direction}_{asked}")
        proc = run_convert("--direction", direction, "--load-dir", load, "--save-dir", save, "--model-family", asked)
        assert_refused(proc, f"--model-family {asked}", f"a {found} model", f"--model-family auto or {found}")
        assert not os.path.exists(save)


@pytest.mark.slow
def test_not_a_model_directory_is_refused(tmp_path):
    proc = run_convert("--direction", "hf2mcore", "--load-dir", str(tmp_path), "--save-dir", str(tmp_path / "ck"))
    assert_refused(proc, f"{tmp_path}/config.json does not exist", "save_pretrained")
    proc = run_convert("--direction", "mcore2hf", "--load-dir", str(tmp_path), "--save-dir", str(tmp_path / "hf"))
    assert_refused(proc, f"{tmp_path} holds no checkpoint", "--save")
    assert files_under(str(tmp_path)) == []


# ------------------------------------------------------------------------------ the models themselves

def test_tiny_models_are_what_the_matrix_needs():
    """Each family's model has the features its cases are for (cheap: no conversion)."""
    models = {f: build_hf_model(f) for f in FAMILIES}
    for f, m in models.items():
        assert m.config.vocab_size == VOCAB and m.config.tie_word_embeddings == (f in TIED)
        assert m.dtype == FAMILIES[f].dtype
    assert models["llama"].config.num_key_value_heads < models["llama"].config.num_attention_heads
    assert models["mistral"].config.num_key_value_heads < models["mistral"].config.num_attention_heads
    assert models["mistral"].config.sliding_window == 4096  # the default, longer than verify's 64 positions
    qwen = models["qwen2"]
    assert qwen.config.head_dim * qwen.config.num_attention_heads != qwen.config.hidden_size
    assert qwen.model.layers[0].self_attn.q_proj.bias is not None
    assert models["gpt2"].config.activation_function == "gelu_new"
    norms = [p for n, p in models["llama"].named_parameters() if "norm" in n]
    assert all(not torch.equal(norms[0], p) for p in norms[1:])  # norms are told apart
