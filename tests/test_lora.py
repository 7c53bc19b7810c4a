"""LoRA in the engine: adapters on megatron-core's column/row-parallel linears train alike at TP1, TP2 with sequence
parallelism, PP2 and DP2 with ZeRO-1; the base stays frozen (no gradient buffers, no optimizer state); a LoRA
checkpoint resumes exactly; a base checkpoint starts LoRA; the export merges the adapters or writes a PEFT adapter
directory that peft loads onto the base model with the merged model's logits."""
from __future__ import annotations

import json
import re
import pytest
import torch

from engine_utils import assert_trains_like, full_weights, run_engine, train_losses

# A Llama-style tiny model (SwiGLU fc1 = [gate; up], grouped-query attention): every adapter layout case
LLAMA = ("--mock-data --vocab-size 128 --num-layers 4 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 "
         "--ffn-hidden-size 96 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
         "--untie-embeddings-and-output-weights --seq-length 32 --micro-batch-size 2 --global-batch-size 8 "
         "--train-iters 5 --lr 1e-2 --log-interval 1 --eval-interval 5 --eval-iters 1 --hidden-dropout 0 "
         "--attention-dropout 0 --init-layout-invariant --seed 7").split()
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_tp1")
    lines, proc = run_engine(d, 1, *LORA, "--save", str(d / "ck"), base=LLAMA)
    return lines, full_weights(str(d / "ck" / "iter_0000005")), proc


LAYOUTS = {  # name: (processes, flags)
    # the adapters' sequence-parallel paths (gathered input, reduce-scattered partial sums, B's gradient over TP)
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    # without sequence parallelism: all-reduced partial sums
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    # slow (CI time): pipelined with the distributed optimizer holding the adapters, data parallel, PP alone
    "tp2_pp2_zero1": pytest.param((4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                       "--zero-1-memory-optimization"]), marks=pytest.mark.slow),
    "dp2_zero1": pytest.param((2, ["--zero-1-memory-optimization"]), marks=pytest.mark.slow),
    "pp2": pytest.param((2, ["--pipeline-model-parallel-size", "2"]), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_lora_trains_alike_in_every_layout(reference, tmp_path, layout):
    """Same losses, gradient norms and weights (adapters and the frozen base) as one process, 1e-5."""
    nproc, flags = layout
    lines, _ = run_engine(tmp_path, nproc, *LORA, *flags, "--save", str(tmp_path / "ck"), base=LLAMA)
    assert_trains_like(reference[:2], lines, full_weights(str(tmp_path / "ck" / "iter_0000005")))


def test_base_is_frozen_and_holds_no_training_state(reference):
    """After 5 steps the base weights are their initial values and every adapter B moved from 0; gradient buffers
    and optimizer state are the adapters' only (fp32: 4 and 8 bytes a trainable parameter)."""
    from megatron_patch.models.init import initial_tensor

    lines, weights, proc = reference
    adapters = {k: v for k, v in weights.items() if k.endswith((".lora_A", ".lora_B"))}
    assert len(adapters) == 4 * 2 and all(v.shape[0] == 4 for v in adapters.values())  # (qkv, proj, fc1, fc2) x (A, B), 4 layers
    assert all(v[i].abs().max() > 0 for k, v in adapters.items() if k.endswith(".lora_B") for i in range(4))
    for k, w in weights.items():
        if k in adapters:
            continue
        if k.startswith("decoder.layers."):  # stacked: layer i's initial value is drawn from its own global name
            want = torch.stack([initial_tensor(k.replace("decoder.layers.", f"decoder.layers.{i}."), w.shape[1:], 7,
                                               0.02) for i in range(w.shape[0])])
        else:
            want = initial_tensor(k, w.shape, 7, 0.02)
        torch.testing.assert_close(w, want, rtol=0, atol=0, msg=k)
    trainable = sum(v.numel() for v in adapters.values())
    m = re.search(r"gradient buffers ([\d.]+) MiB, optimizer state ([\d.]+) MiB", proc.stdout)
    assert m, proc.stdout[-2000:]
    assert float(m.group(1)) == pytest.approx(4 * trainable / 2**20, abs=0.06)
    assert float(m.group(2)) == pytest.approx(8 * trainable / 2**20, abs=0.06)
    assert f"{trainable / 1e6:.3f}M trainable" in proc.stdout


def test_lora_resumes_exactly(tmp_path):
    """Dropout on (hidden, attention and the adapters'): stopped at 3 and resumed, the last two iterations and the
    weights equal the uninterrupted run's; the adapters' settings come from the checkpoint."""
    drop = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--lora-dropout", "0.1"]
    straight, _ = run_engine(tmp_path / "a", 1, *LORA, *drop, "--save", str(tmp_path / "s"), base=LLAMA)
    first, _ = run_engine(tmp_path / "b", 1, *LORA, *drop, "--exit-interval", "3", "--save", str(tmp_path / "ck"),
                          base=LLAMA)
    second, proc = run_engine(tmp_path / "c", 1, *drop, "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "ck"),
                              base=LLAMA)
    assert "(iteration 3)" in proc.stdout and "LoRA rank 4" in proc.stdout
    assert train_losses(first) + train_losses(second) == pytest.approx(train_losses(straight), rel=1e-6)
    a, b = full_weights(str(tmp_path / "s" / "iter_0000005")), full_weights(str(tmp_path / "ck" / "iter_0000005"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.slow  # CI time; a mistake here fails loudly (a missing-key error), not silently
def test_lora_starts_from_a_base_checkpoint(tmp_path):
    """A checkpoint without adapters (a base) loaded by a LoRA run gives its weights as the frozen base and starts at
    iteration 0; a PEFT export of it is refused (it has no adapters)."""
    run_engine(tmp_path / "base", 1, "--save", str(tmp_path / "base_ck"), "--train-iters", "2", base=LLAMA)
    lines, proc = run_engine(tmp_path / "d", 1, *LORA, "--load", str(tmp_path / "base_ck"), "--save",
                             str(tmp_path / "lora_ck"), base=LLAMA)
    assert "loaded the base weights" in proc.stdout and len(train_losses(lines)) == 5
    base, tuned = full_weights(str(tmp_path / "base_ck" / "iter_0000002")), \
        full_weights(str(tmp_path / "lora_ck" / "iter_0000005"))
    for k, w in base.items():
        torch.testing.assert_close(tuned[k], w, rtol=0, atol=0, msg=k)
    assert any(k.endswith(".lora_B") for k in tuned)
    from conftest import run_tool

    out = run_tool("convert_checkpoint.py", "--direction", "mcore2hf", "--load-dir", str(tmp_path / "base_ck"),
                   "--save-dir", str(tmp_path / "x"), "--lora-format", "peft", check=False)
    assert out.returncode != 0 and "has none" in out.stdout + out.stderr


def test_lora_flags_are_checked():
    from megatron_patch.config import ConfigError, parse_args

    def refusal(*flags):
        with pytest.raises(ConfigError) as e:
            parse_args([*LLAMA, *flags]).validate(1)
        return str(e.value)

    assert "fuses q_proj/k_proj/v_proj" in refusal("--lora-rank", "4", "--lora-target", "q_proj", "v_proj")
    assert "not a layer LoRA can adapt" in refusal("--lora-rank", "4", "--lora-target", "lm_head")
    assert "--lora-dropout 1.5" in refusal("--lora-rank", "4", "--lora-dropout", "1.5")
    assert "zero-2" in refusal("--lora-rank", "4", "--zero-2-memory-optimization")
    cfg = parse_args([*LLAMA, "--lora-rank", "4", "--lora-target", "q_proj", "k_proj", "v_proj", "o_proj"]).validate(1)
    assert cfg.lora_rank == 4


@pytest.fixture(scope="module")
def lora_from_hf(tmp_path_factory, sft_data):
    """A LoRA fine-tuning (packed SFT) of a tiny Hugging Face Qwen2 model with random weights and its own tokenizer,
    on two processes (TP2: the export reads the adapters' slices back whole): the checkpoint and the base."""
    from megatron_patch.conversion.build_hf import build

    d, data = tmp_path_factory.mktemp("lora_hf"), sft_data

    build("qwen2", "tiny", data.tok, str(d / "base"))
    flags = ["--load-hf", str(d / "base"), "--data-path", data.prefix, "--tokenizer-type", "HuggingFaceTokenizer",
             "--tokenizer-model", data.tok, "--sft", "--seq-length", "128", "--split", "100,0,0", "--eval-iters", "0",
             "--train-iters", "4", "--lr", "1e-2", "--log-interval", "1", "--micro-batch-size", "2",
             "--global-batch-size", str(data.packed_samples), "--lora-rank", "4", "--lora-alpha", "16",
             "--lora-target", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
             "--tensor-model-parallel-size", "2", "--save", str(d / "ck")]
    lines, _ = run_engine(d / "run", 2, *flags, base=[])
    assert train_losses(lines)[-1] < train_losses(lines)[0]
    return d


def test_peft_adapter_loads_and_matches_the_merged_export(lora_from_hf):
    """mcore2hf merges (its own verify: the engine model with adapters against the export); --lora-format peft
    writes PEFT's files and key names, split per Hugging Face module, and PeftModel on the base model gives the
    merged model's logits (1e-4) and not the base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from conftest import run_tool

    d = lora_from_hf
    merged = run_tool("convert_checkpoint.py", "--direction", "mcore2hf", "--load-dir", str(d / "ck"), "--save-dir",
                      str(d / "merged"))
    assert "verify passed" in merged.stdout and "merged into the weights" in merged.stdout
    peft_dir = d / "peft"  # its own verify would repeat what the logits below show (merged == engine: verified)
    out = run_tool("convert_checkpoint.py", "--direction", "mcore2hf", "--load-dir", str(d / "ck"), "--save-dir",
                   str(peft_dir), "--lora-format", "peft", "--no-verify")
    assert "PEFT adapters" in out.stdout
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16 and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                "v_proj"]
    from safetensors.torch import load_file

    keys = load_file(str(peft_dir / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight" in keys
    base = AutoModelForCausalLM.from_pretrained(str(d / "base"), dtype=torch.float32).eval()
    tokens = torch.randint(0, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = base(tokens).logits
        tuned = PeftModel.from_pretrained(base, str(peft_dir)).eval()(tokens).logits
        whole = AutoModelForCausalLM.from_pretrained(str(d / "merged"), dtype=torch.float32).eval()(tokens).logits
    assert (tuned - whole).abs().max() < 1e-4
    assert (tuned - plain).abs().max() > 1e-2  # the adapters change the model
