"""mcore2hf of models trained in the engine (not converted from Hugging Face), verify's verdict, and the
conversion's refusals of broken Hugging Face files.

1. A tiny Qwen2 trained in the engine with every size flag left at its default (--ffn-hidden-size,
   --kv-channels, --num-query-groups, --max-position-embeddings) and a non-default --rotary-base and
   --norm-epsilon exports with mcore2hf as typed (verify on by default); config.json holds the trained
   model's dimensions, and transformers' model of the export gives the logits the engine's own model gave
   in the training process (tests/trained_model_worker.py, independent of verify) on the same tokens.
   Llama (GQA) and Mistral: the same, slow.
2. A wrong export (one embedding row off, seen at a few late positions of one batch row only) fails
   verify with exit 3 and its one-line verdict, and leaves nothing behind; --no-verify exports it.
3. verify's comparison sees a difference at any single position (unit), and covers every learned
   position row (unit).
4. A truncated or corrupt safetensors file: one line naming it, exit 2, before any worker starts.
5. Staging (unit): a conversion's directory is published by rename only when complete and verified.

Budget: the Qwen2 training ~25 s (one process), each mcore2hf with verify ~15 s, the rest a few seconds.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conversion_utils import (  # noqa: E402
    assert_no_staging_dirs, explain, files_under, late_token, run_convert, save_hf_model,
)
from engine_utils import run_engine  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trained_model_worker.py")
SEQ, VOCAB, HIDDEN, HEADS = 32, 100, 64, 4  # vocabulary padded to 128 by the default --make-vocab-size-divisible-by
ROTARY_BASE, NORM_EPS = 500, 1e-3  # neither the families' defaults nor transformers'
# Sizes and nothing else: ffn, kv_channels, query groups and max positions stay at their defaults (None).
# --init-method-std 0.2: attention far from uniform, so the rotary base moves the logits by far more than 1e-5.
BASE = ["--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS), "--mock-data",
        "--vocab-size", str(VOCAB), "--seq-length", str(SEQ), "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "3", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1", "--init-method-std", "0.2",
        "--rotary-base", str(ROTARY_BASE), "--norm-epsilon", str(NORM_EPS)]
FAMILIES = {  # family: (extra flags, query groups the model has, tied)
    "qwen2": ([], HEADS, False),  # QKV biases; groups left at the default: one per head
    "llama": (["--num-query-groups", "2"], 2, False),
    "mistral": ([], HEADS, False),
    # today's families (slow): Llama 3.x's RoPE scaling and Qwen3's q/k norms trained from scratch, exported
    "llama3": (["--num-query-groups", "2", "--rope-scaling-original-max-position-embeddings", "16",
                "--max-position-embeddings", str(SEQ)], 2, False),
    "qwen3": (["--num-query-groups", "2", "--kv-channels", str(HIDDEN // HEADS)], 2, False),
}
LOGIT_TOLERANCE = 1e-5  # both fp32, the same operations: measured 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """family -> (--save root, {"tokens", "logits"} of the trained model in the training process)."""
    root, done = tmp_path_factory.mktemp("trained"), {}

    def get(family: str):
        if family not in done:
            work = root / family
            out = str(work / "engine_logits.pt")
            run_engine(work, 1, "--model-family", family, *BASE, *FAMILIES[family][0], "--save", str(work / "ck"),
                       base=[], script=[WORKER, out])
            done[family] = (str(work / "ck"), torch.load(out, weights_only=True))
        return done[family]
    return get


def _hf_logits(model_dir: str, tokens: torch.Tensor, **config_changes) -> torch.Tensor:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    for key, value in config_changes.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f == "qwen2" else pytest.mark.slow)
                                    for f in FAMILIES])
def test_export_of_an_engine_trained_model_is_that_model(family, trained, tmp_path):
    ck, engine = trained(family)
    out = str(tmp_path / "hf")
    proc = run_convert("--direction", "mcore2hf", "--load-dir", ck, "--save-dir", out)  # verify: on by default
    assert proc.returncode == 0, explain(proc)
    assert "verify passed" in proc.stdout and f"saved {out}" in proc.stdout, explain(proc)
    assert_no_staging_dirs(str(tmp_path))

    config = json.load(open(os.path.join(out, "config.json")))
    _, groups, tied = FAMILIES[family]
    assert config["model_type"] == {"llama3": "llama"}.get(family, family)
    if family == "llama3":
        assert config["rope_parameters"]["rope_type"] == "llama3"
        assert config["rope_parameters"]["original_max_position_embeddings"] == 16
    assert config["rope_parameters"]["rope_theta"] == ROTARY_BASE
    assert config["rms_norm_eps"] == NORM_EPS
    assert config["intermediate_size"] == 4 * HIDDEN  # --ffn-hidden-size left at its default: the builder's 4 x hidden
    assert config["head_dim"] == HIDDEN // HEADS and config["num_key_value_heads"] == groups
    assert config["vocab_size"] == VOCAB and config["max_position_embeddings"] == SEQ
    assert config["tie_word_embeddings"] == tied and config["hidden_size"] == HIDDEN

    tokens, want = engine["tokens"], engine["logits"]
    got = _hf_logits(out, tokens)
    assert got.shape == want.shape == (2, SEQ, VOCAB)
    diff = (got - want).abs().max().item()
    assert diff <= LOGIT_TOLERANCE, f"the export's logits differ from the engine's by {diff:.3e}"
    # The comparison can tell a wrong rotary base (transformers' default) from the right one.
    wrong = _hf_logits(out, tokens, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert (wrong - want).abs().max().item() > 1000 * LOGIT_TOLERANCE


def test_a_wrong_export_fails_verify_and_leaves_nothing(trained, tmp_path):
    """One input-embedding row off (a token of verify's second row only, first seen in its second half): verify
    exits 3 with its one-line verdict, and neither --save-dir nor a staging directory is left. (The export was
    written and only the verify refused it: its log says both; --no-verify's export is test_conversion_today's
    mcore2hf --no-verify of every family.)"""
    ck, _ = trained("qwen2")
    from megatron_patch.conversion.verify import sample_tokens

    tokens = sample_tokens(VOCAB, SEQ)
    token = late_token(VOCAB, SEQ)
    first = tokens[1].tolist().index(token)
    assert token not in tokens[0].tolist() and SEQ // 2 <= first < SEQ - 1  # a few late positions of one row

    out = tmp_path / "hf"
    proc = run_convert("--direction", "mcore2hf", "--load-dir", ck, "--save-dir", str(out), plant="export_late_token_row")
    assert proc.returncode == 3, explain(proc)
    verdicts = [x for x in proc.stdout.splitlines() if x.startswith("verify ")]
    assert "wrote config.json, 1 safetensors file(s)" in proc.stdout, explain(proc)  # written, then refused
    assert len(verdicts) == 1 and verdicts[0].startswith("verify FAILED: max |logit difference|"), explain(proc)
    assert f"over {2 * SEQ} positions" in verdicts[0], verdicts[0]
    errors = [x for x in proc.stderr.splitlines() if x.startswith(("verification failed", "conversion error"))]
    assert len(errors) == 1 and errors[0].startswith("verification failed"), explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    assert not out.exists() and f"nothing written to {out}" in proc.stdout, explain(proc)
    assert_no_staging_dirs(str(tmp_path))


# ------------------------------------------------------------------------------------------- staging, unit

def test_publish_renames_only_a_complete_conversion(tmp_path, capsys):
    """convert.publish, which both directions write through: the files go to a staging directory next to
    --save-dir, which becomes --save-dir on exit status 0 only. A failed verify (3), a conversion error (2), a
    worker that died (1), an exception or Ctrl-C leave --save-dir as it was (absent, or the empty directory the
    user made) and no staging directory, and say so. Budget < 1 s."""
    import shutil

    from megatron_patch.conversion.convert import publish

    def writer(status=0, error=None):
        def write(staging: str) -> int:
            assert os.path.dirname(staging) == str(tmp_path) and os.path.basename(staging).startswith(".out.partial-")
            with open(os.path.join(staging, "model.bin"), "w") as f:
                f.write("weights")
            if error is not None:
                raise error
            return status
        return write

    out = tmp_path / "out"
    umask = os.umask(0)
    os.umask(umask)
    for made_by_user in (False, True):
        if made_by_user:
            out.mkdir()
        for status, error, why in ((3, None, "it failed verification"), (2, None, "the conversion failed"),
                                   (1, None, "the conversion failed"), (None, KeyboardInterrupt(), "interrupted"),
                                   (None, RuntimeError("a bug"), "the conversion failed")):
            if error is None:
                assert publish(str(out), "hf2mcore", writer(status), True) == status
            else:
                with pytest.raises(type(error)):
                    publish(str(out), "hf2mcore", writer(error=error), True)
            assert out.exists() == made_by_user and files_under(str(out)) == [], (status, error)
            assert_no_staging_dirs(str(tmp_path))
            assert f"hf2mcore: nothing written to {out} ({why})" in capsys.readouterr().out
        assert publish(str(out), "hf2mcore", writer(0), False) == 0
        assert files_under(str(out)) == ["model.bin"] and os.stat(out).st_mode & 0o777 == 0o777 & ~umask
        assert_no_staging_dirs(str(tmp_path))
        assert f"saved {out} (not verified" in capsys.readouterr().out
        shutil.rmtree(out)


# ------------------------------------------------------------------------------------------- verify, unit

def test_compare_sees_a_difference_at_any_single_position():
    """verify.compare looks at every batch row, position and real vocabulary entry (and not at the padding)."""
    from megatron_patch.conversion.verify import TOLERANCE, compare

    torch.manual_seed(0)
    batch, seq, vocab, padded = 2, 6, 11, 16
    hf = torch.randn(batch, seq, vocab)
    engine = torch.cat([hf, 100 * torch.randn(batch, seq, padded - vocab)], dim=-1)  # padding: anything
    assert compare(hf, engine, vocab)["passed"]
    for b in range(batch):
        for s in range(seq):
            for v in (0, vocab - 1):
                off = engine.clone()
                off[b, s, v] += 3 * TOLERANCE
                report = compare(hf, off, vocab)
                assert not report["passed"], f"a difference at row {b}, position {s}, token {v} went unseen"
                assert report["max_abs_diff"] == pytest.approx(3 * TOLERANCE, rel=1e-2)
                off[b, s, v] -= 2.5 * TOLERANCE  # within the tolerance
                assert compare(hf, off, vocab)["passed"]
    # a top-1 flip within the tolerance fails too
    close = hf.clone()
    top = close[1, 4].argmax()
    second = close[1, 4].topk(2).indices[1]
    close[1, 4, second] = close[1, 4, top] - TOLERANCE / 4
    flipped = close.clone()
    flipped[1, 4, second] += TOLERANCE / 2
    report = compare(close, torch.cat([flipped, engine[..., vocab:]], dim=-1), vocab)
    assert report["max_abs_diff"] <= TOLERANCE and not report["passed"]
    assert report["top1_agreement"] == pytest.approx(1 - 1 / (batch * seq))


def test_verify_covers_every_learned_position_row():
    from megatron_patch.config import Config
    from megatron_patch.conversion.worker import verify_length

    assert verify_length(Config(position_embedding_type="learned_absolute", max_position_embeddings=1024), 64) == 1024
    assert verify_length(Config(position_embedding_type="rope", max_position_embeddings=4096), 64) == 64
    assert verify_length(Config(position_embedding_type="rope", max_position_embeddings=32), 64) == 32


def test_export_checker_refuses_tensors_config_json_does_not_describe():
    from megatron_patch.conversion.architecture import ExportChecker
    from megatron_patch.conversion.mapping import ConversionError
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=1,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, tie_word_embeddings=False,
                         architectures=["Qwen2ForCausalLM"]).to_dict()
    check = ExportChecker(config, "ck -> out")
    check.add("model.layers.0.mlp.up_proj.weight", (4 * HIDDEN, HIDDEN))
    with pytest.raises(ConversionError, match=r"gate_proj.weight has the shape \(352, 64\).*has \(256, 64\)"):
        check.add("model.layers.0.mlp.gate_proj.weight", (352, HIDDEN))
    with pytest.raises(ConversionError, match="does not have"):
        check.add("model.layers.0.mlp.extra.weight", (4, 4))
    with pytest.raises(ConversionError, match="has 14 parameter.s. the checkpoint does not give, e.g. lm_head.weight"):
        check.finish()


@pytest.mark.parametrize("family", ["gpt", "llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "bert"])
def test_every_family_exports_a_config_with_its_sizes_left_at_defaults(family):
    """A run given only layers, hidden size and heads (ffn, kv_channels, query groups, expert width and max
    positions left at their defaults): config.json has the sizes the engine builds, and transformers builds its
    model (on the meta device) from it. Cheap: no process group, no weights."""
    from megatron_patch.config import parse_args
    from megatron_patch.conversion import tables
    from megatron_patch.conversion.architecture import hf_parameter_shapes, resolve

    flags = ["--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS), "--mock-data",
             "--vocab-size", str(VOCAB), "--seq-length", str(SEQ)]
    entry = "bert" if family == "bert" else "gpt"  # pretrain_megatron_bert.py's parser for BERT
    stored = parse_args(flags if entry == "bert" else ["--model-family", family, *flags], model=entry).validate(1)
    assert stored.ffn_hidden_size is None and stored.kv_channels is None and stored.num_query_groups is None
    cfg = resolve(stored)
    module = tables.for_engine(cfg)
    config = module.hf_config(cfg, VOCAB, None)
    config = module.export_config(config, cfg)
    shapes = hf_parameter_shapes(config)
    ffn = {"mixtral": cfg.moe_ffn_hidden_size}.get(family, 4 * HIDDEN)
    width = config.get("intermediate_size") or config.get("n_inner")
    assert width == ffn and ffn is not None, (family, width, ffn)
    positions = 512 if family == "bert" else SEQ  # BERT's family preset; the others: --seq-length
    assert stored.max_position_embeddings == positions
    assert config.get("max_position_embeddings", config.get("n_positions")) == positions
    assert config.get("num_key_value_heads", HEADS) == HEADS and config["vocab_size"] == VOCAB
    assert any(shape[0] == VOCAB for name, shape in shapes.items() if "emb" in name or "wte" in name), shapes


# ---------------------------------------------------------------------------- broken safetensors files

def _truncate(file: str) -> None:
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)


def _garbage_header(file: str) -> None:
    with open(file, "r+b") as f:
        f.write(b"\xff" * 8 + b"not a safetensors header")


@pytest.mark.parametrize("damage,shard", [(_truncate, "model-00002-of-00003.safetensors"),
                                          (_garbage_header, "model.safetensors")], ids=["truncated", "garbage_header"])
def test_broken_safetensors_file_is_named_in_one_line(damage, shard, tmp_path):
    """A truncated later shard, a file whose header is not safetensors: exit 2, one line naming the file, no
    traceback, nothing written."""
    src = save_hf_model("qwen2", str(tmp_path / "hf"))
    if shard != "model.safetensors":
        import shutil

        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(src)
        shutil.rmtree(src)
        model.save_pretrained(src, max_shard_size="120KB")
    file = os.path.join(src, shard)
    assert os.path.isfile(file), os.listdir(src)
    damage(file)
    save = tmp_path / "ck"
    proc = run_convert("--direction", "hf2mcore", "--load-dir", src, "--save-dir", str(save))
    assert proc.returncode == 2, explain(proc)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("conversion error")]
    assert len(lines) == 1 and lines[0].startswith(f"conversion error: {file} is not a readable safetensors file"), \
        explain(proc)
    assert "truncated or corrupt" in lines[0] and "Traceback" not in proc.stderr
    assert not save.exists()
