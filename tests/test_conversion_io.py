"""The two readers/writers the conversion is built on: Hugging Face directories (hf_io) and engine
checkpoints as global megatron-core tensors (mcore_reader).

References are independent of the code under test: transformers itself (save_pretrained /
from_pretrained), the engine's own TP1 PP1 model built in a separate process (this file run as a
script), and torch's dcp_to_torch_save (tests/engine_utils.py::full_weights). Engine runs train one
iteration at --lr 0, so with --init-layout-invariant every layout holds the same weights."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_utils import ROOT, full_weights, run_engine  # noqa: E402

from megatron_patch.conversion.hf_io import (  # noqa: E402
    HFCheckpointError, HFCheckpointReader, HFCheckpointWriter, copy_aux_files, read_hf_config,
)

# ----------------------------------------------------------------------------------------------- HF side


def _llama(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).to(dtype)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


def _files(d):
    return sorted(os.listdir(d))


def test_writer_writes_what_transformers_writes(tmp_path):
    """Same tensors, same max shard size: our shards and index are byte-identical to save_pretrained's,
    and from_pretrained loads ours bit for bit."""
    from transformers import AutoModelForCausalLM

    model = _llama()
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    model.config.save_pretrained(ours)
    writer = HFCheckpointWriter(ours, max_shard_bytes=20_000)
    for name, tensor in model.state_dict().items():
        writer.add(name, tensor)
    written = writer.close()
    model.save_pretrained(theirs, max_shard_size="20KB")  # transformers reads "20KB" as 20,000 bytes
    weights = [f for f in _files(theirs) if f.startswith("model")]
    assert len(weights) > 3 and written == weights[:-1] + ["model.safetensors.index.json"]
    assert [f for f in _files(ours) if f.startswith("model")] == weights  # no temporary file left
    for f in weights:
        assert open(os.path.join(ours, f), "rb").read() == open(os.path.join(theirs, f), "rb").read(), f
    loaded = AutoModelForCausalLM.from_pretrained(ours).state_dict()
    assert loaded.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor), name


def test_single_file_bf16_and_gpt2_tied(tmp_path):
    """One shard -> model.safetensors (no index); bf16 survives; GPT-2's tied lm_head is in neither the
    files nor the reader's keys, and from_pretrained restores the tie."""
    from transformers import AutoModelForCausalLM

    for model, name in ((_llama(torch.bfloat16), "llama"), (_gpt2(), "gpt2")):
        out = str(tmp_path / name)
        model.config.save_pretrained(out)
        saved = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or name == "llama"}
        with HFCheckpointWriter(out) as writer:
            for k, v in saved.items():
                writer.add(k, v)
        assert _files(out) == ["config.json", "model.safetensors"]
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=model.dtype).state_dict()
        for k, v in model.state_dict().items():
            assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
        reader = HFCheckpointReader(out)
        assert sorted(reader.keys()) == sorted(saved)
        assert reader.dtype_of("lm_head.weight" if name == "llama" else "transformer.wte.weight") == model.dtype


def test_reader_reads_transformers_output(tmp_path):
    """save_pretrained's sharded and single-file output, read tensor by tensor, bit for bit."""
    for model, shard in ((_llama(torch.bfloat16), "20KB"), (_llama(), "20KB"), (_gpt2(), "5GB")):
        out = str(tmp_path / f"m{len(os.listdir(tmp_path))}")
        model.save_pretrained(out, max_shard_size=shard)
        reader = HFCheckpointReader(out)
        expected = model.state_dict()
        if "lm_head.weight" not in reader:  # GPT-2: transformers drops the tied copy
            expected.pop("lm_head.weight")
        assert sorted(reader.keys()) == sorted(expected)
        for name, tensor in expected.items():
            got = reader.get(name)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
            assert reader.shape_of(name) == list(tensor.shape) and reader.dtype_of(name) == tensor.dtype
        assert read_hf_config(out)["model_type"] == model.config.model_type


def test_writer_takes_views_and_shared_tensors(tmp_path):
    """Tied names (one tensor twice), transposed and sliced views: safetensors refuses shared or
    non-contiguous tensors, so the writer gives each its own storage, and a slice does not keep its base."""
    stacked = torch.randn(4, 8, 6)
    emb = torch.randn(10, 6)
    tensors = {"emb": emb, "tied": emb, "t": emb.t(), **{f"layer{i}": stacked[i] for i in range(4)}}
    out = str(tmp_path / "views")
    writer = HFCheckpointWriter(out, max_shard_bytes=300)
    for k, v in tensors.items():
        writer.add(k, v)
        if k.startswith("layer"):
            queued = writer._shard[k]
            assert queued.untyped_storage().nbytes() == queued.numel() * 4  # not the whole stacked base
    writer.close()
    reader = HFCheckpointReader(out)
    for k, v in tensors.items():
        assert torch.equal(reader.get(k), v), k


def test_interrupted_export_leaves_nothing_complete(tmp_path):
    out = str(tmp_path / "export")
    old = HFCheckpointWriter(out)  # an earlier, complete single-file export in the same directory
    old.add("stale", torch.zeros(3))
    old.close()
    writer = HFCheckpointWriter(out, max_shard_bytes=100)
    for i in range(5):
        writer.add(f"w{i}", torch.randn(20))  # 80 bytes: one shard each, all written already
    assert [f for f in _files(out) if not f.startswith(".")] == ["model.safetensors"]  # only the old export
    with pytest.raises(RuntimeError, match="export failed"):
        with HFCheckpointWriter(out, max_shard_bytes=100) as failing:
            for i in range(5):
                failing.add(f"w{i}", torch.randn(20))
            raise RuntimeError("export failed")
    writer.close()
    shards = [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]
    assert _files(out) == shards + ["model.safetensors.index.json"]
    assert sorted(HFCheckpointReader(out).keys()) == [f"w{i}" for i in range(5)]  # the stale file is gone
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert index["metadata"] == {"total_parameters": 100, "total_size": 400}


def test_hf_errors_name_the_file(tmp_path):
    d = str(tmp_path)
    with pytest.raises(HFCheckpointError, match="config.json does not exist"):
        read_hf_config(d)
    open(os.path.join(d, "config.json"), "w").write("{not json")
    with pytest.raises(HFCheckpointError, match="config.json is not valid JSON"):
        read_hf_config(d)
    open(os.path.join(d, "pytorch_model.bin"), "w").write("x")
    with pytest.raises(HFCheckpointError, match="neither model.safetensors.*pickled .bin"):
        HFCheckpointReader(d)
    writer = HFCheckpointWriter(d, max_shard_bytes=10)
    writer.add("a", torch.zeros(4))
    with pytest.raises(HFCheckpointError, match="'a' was added twice"):
        writer.add("a", torch.zeros(4))
    writer.add("b", torch.zeros(4))
    writer.close()
    reader = HFCheckpointReader(d)
    with pytest.raises(HFCheckpointError, match=r"no tensor 'c' in .*model.safetensors.index.json"):
        reader.get("c")
    os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))
    with pytest.raises(HFCheckpointError, match="names the shard model-00002-of-00002.safetensors, which is not in"):
        HFCheckpointReader(d)


def test_copy_aux_files(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    for name in ("generation_config.json", "tokenizer.json", "merges.txt", "config.json", "model.safetensors"):
        (src / name).write_text(name)
    assert copy_aux_files(str(src), str(dst)) == ["generation_config.json", "tokenizer.json", "merges.txt"]
    assert _files(dst) == ["generation_config.json", "merges.txt", "tokenizer.json"]
    assert (dst / "merges.txt").read_text() == "merges.txt"


# ------------------------------------------------------------------------------------------ Megatron side

ONE_ITER = ["--train-iters", "1", "--eval-iters", "0", "--lr", "0"]  # lr 0: the weights stay at the initial values
LLAMA = ("--model-family llama --num-layers 4 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 "
         "--ffn-hidden-size 176").split()
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
RUNS = {  # name: (processes, family flags, layout flags)
    "tp1": (1, [], []),
    "tp2pp2_vpp": (4, [], [*TP2, *PP2, "--num-layers-per-virtual-pipeline-stage", "1"]),
    # SwiGLU at TP2: its fc1 stored as TP-global gate and up halves (fsdp_dtensor.py); PP2: global layer numbers
    "llama_tp2pp2_zero2_bf16": (4, [*LLAMA, "--bf16"], [*TP2, *PP2, "--zero-2-memory-optimization"]),
    "llama_tp2dp2_zero1_bf16": (4, [*LLAMA, "--bf16"], [*TP2, "--zero-1-memory-optimization"]),
}
# ZeRO-2 (Megatron-FSDP) checkpoints hold the fp32 main weights, also in bf16 runs; dist_checkpointing the model's
SAVES_FP32 = {"llama_tp2pp2_zero2_bf16"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> the --save root of that engine run (run on first use, once per module)."""
    root, done = tmp_path_factory.mktemp("conversion_io"), {}

    def get(name: str) -> str:
        if name not in done:
            nproc, family, layout = RUNS[name]
            save = str(root / name / "ckpt")
            run_engine(root / name, nproc, *ONE_ITER, *family, *layout, "--save", save, torchrun=False)
            done[name] = save
        return done[name]
    return get


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """family flags -> the state dict of the engine's unwrapped TP1 PP1 model at initialization, built in
    another process (megatron-core's process groups and the CPU patches stay out of pytest's): one process builds
    the model of every family RUNS uses, one after another, on first use (each start-up costs seconds)."""
    root, done = tmp_path_factory.mktemp("reference"), {}
    families = sorted({tuple(family) for _, family, _ in RUNS.values()})

    def get(family: tuple) -> dict:
        if not done:
            jobs = [(str(root / f"ref{i}.pt"), list(f)) for i, f in enumerate(families)]
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), json.dumps(jobs)], capture_output=True,
                                  text=True, cwd=ROOT, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
            assert proc.returncode == 0, proc.stderr[-3000:]
            done.update({f: torch.load(out, weights_only=True) for f, (out, _) in zip(families, jobs)})
        return done[family]
    return get


def _reader(path):
    from megatron_patch.conversion.mcore_reader import MegatronCheckpointReader

    return MegatronCheckpointReader(path)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if n == "tp2pp2_vpp" else ())
                                  for n in RUNS])  # VPP: slow for CI time; the layout tests cover VPP reading
def test_reader_gives_the_tp1_models_state_dict(name, checkpoint, reference):
    """Every layout (TP, PP, VPP, ZeRO-1 and ZeRO-2 formats, bf16) reads back as exactly the TP1 PP1
    model: same names in the same order, same values bit for bit, in the dtype the format saves."""
    reader = _reader(checkpoint(name))
    expected = reference(tuple(RUNS[name][1]))
    assert reader.keys() == list(expected)
    for key, tensor in expected.items():
        if name in SAVES_FP32:
            tensor = tensor.float()
        got = reader.get(key)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), key
        assert reader.shape_of(key) == list(tensor.shape) and reader.dtype_of(key) == tensor.dtype


def _older_zero2_checkpoint(root: str, path):
    """A ZeRO-2 checkpoint as written before fc1 was stored split, at `path`, made from today's TP2 checkpoint under
    `root` (read whole by torch's dcp_to_torch_save, not by the reader under test): its model entries (weights and
    _extra_state; no optimizer state) with each fc1 whole and interleaved, [g0; u0; g1; u1], the manifest without
    the fully-reshardable mark."""
    import re

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from megatron_patch.config.checkpoint_layout import read_manifest, write_manifest

    source = _reader(root).path
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    whole = str(path) + ".pt"
    dcp_to_torch_save(source, whole)
    state = torch.load(whole, weights_only=False)  # this test's own checkpoint: _extra_state entries are objects
    model = {f"model.{k}": v for k, v in state["model"].items()} if isinstance(state.get("model"), dict) else \
        {k: v for k, v in state.items() if k.startswith("model.")}
    old = {}
    for key, value in model.items():
        half = re.match(r"^(.*\.linear_fc1\.(?:weight|bias))_([wv])$", key)
        if half is None:
            old[key] = value
        elif half.group(2) == "w":  # gate [g0; g1], up [u0; u1] -> [g0; u0; g1; u1]
            up = model[half.group(1) + "_v"]
            old[half.group(1)] = torch.cat([torch.cat(pair) for pair in zip(value.chunk(2), up.chunk(2))])
    dcp.save(old, checkpoint_id=str(path), no_dist=True)
    manifest = read_manifest(source)
    del manifest["optimizer_sharding"]
    write_manifest(str(path), manifest)
    return path


def test_reader_puts_an_older_zero2_checkpoints_swiglu_fc1_in_order(checkpoint, reference, tmp_path):
    """A ZeRO-2 checkpoint written before fc1 was stored split held it whole, which at TP 2 interleaves the ranks'
    halves ([g0; u0; g1; u1]; seen in such a checkpoint). Made here from today's TP2 checkpoint (its model tensors
    rewritten that way, the manifest without the fully-reshardable mark): it still reads as the TP1 model."""
    path = _older_zero2_checkpoint(checkpoint("llama_tp2pp2_zero2_bf16"), tmp_path / "iter_0000001")
    reader = _reader(str(path))
    for key, tensor in reference(tuple(RUNS["llama_tp2pp2_zero2_bf16"][1])).items():
        assert torch.equal(reader.get(key), tensor.float()), key


def test_zero2_export_verifies_through_the_engines_own_loading(checkpoint, tmp_path):
    """mcore2hf --verify of the TP2 PP2 ZeRO-2 SwiGLU checkpoint (a bf16 run: fp32 main weights, exported in bf16):
    verify builds its TP1 model through the engine's resume path (Megatron-FSDP wrapped, fsdp_dtensor), not through
    the reader the export read, so a reader bug (fc1's gate/up halves: plant reader-fc1-halves-caught-by-verify)
    makes it fail instead of being repeated by it. Budget ~15 s (one verify process)."""
    from conversion_utils import explain, run_convert

    out = str(tmp_path / "hf")
    proc = run_convert("--direction", "mcore2hf", "--load-dir", checkpoint("llama_tp2pp2_zero2_bf16"), "--save-dir", out)
    assert proc.returncode == 0 and "verify passed" in proc.stdout, explain(proc)
    assert "verify: the checkpoint's float32 weights rounded to bfloat16" in proc.stdout, explain(proc)
    assert "conversion's reader" not in proc.stdout and "own layout" not in proc.stdout, explain(proc)


@pytest.mark.slow  # CI time: four verify processes
def test_older_zero2_export_verifies_at_its_own_layout(checkpoint, tmp_path):
    """An older ZeRO-2 checkpoint (fc1 interleaved over TP 2; _older_zero2_checkpoint) loads into the engine at its
    own TP/PP only: mcore2hf says so and verifies there (TP2 PP2, four processes), through the engine's loading."""
    from conversion_utils import explain, run_convert

    ck = _older_zero2_checkpoint(checkpoint("llama_tp2pp2_zero2_bf16"), tmp_path / "ck" / "iter_0000001")
    proc = run_convert("--direction", "mcore2hf", "--load-dir", str(ck), "--save-dir", str(tmp_path / "hf"))
    assert proc.returncode == 0 and "verify passed" in proc.stdout, explain(proc)
    assert "verify at the checkpoint's own layout, TP 2 PP 2 (4 processes)" in proc.stdout, explain(proc)
    assert "conversion's reader" not in proc.stdout, explain(proc)


@pytest.mark.parametrize("name", ["tp1", "llama_tp2dp2_zero1_bf16", "llama_tp2pp2_zero2_bf16"])
def test_reader_agrees_with_dcp_to_torch_save(name, checkpoint):
    """A second route to the full weights: torch converts the whole checkpoint at once (full_weights
    stacks ZeRO-2's per-layer names as dist_checkpointing does)."""
    reader = _reader(checkpoint(name))
    full = full_weights(reader.path)
    from megatron_patch.conversion.mcore_reader import TE_NORMS

    def stacked(key):  # our name -> (dist_checkpointing's stacked name, layer)
        parts = key.split(".")
        if key.startswith("decoder.layers."):
            rest = ".".join(parts[3:])
            for te, local in TE_NORMS.items():
                rest = rest.replace(local, te, 1) if rest.startswith(local) else rest
            return "decoder.layers." + rest, int(parts[2])
        return key, None

    used = set()
    for key in reader.keys():
        skey, layer = stacked(key)
        want = full[skey] if layer is None else full[skey][layer]
        assert torch.equal(reader.get(key), want), key
        used.add(skey)
    assert used == set(full)  # nothing the checkpoint holds is missed


@pytest.mark.slow  # CI time: its TP2 PP2 VPP checkpoint is trained for this test alone
def test_reader_reads_one_layer_chunk_per_tp_rank(checkpoint, monkeypatch):
    """A layer is read as a region of its stacked tensor: only that layer's chunks (one per TP rank) are
    read, whatever order the conversion asks for them in."""
    reader = _reader(checkpoint("tp2pp2_vpp"))
    items = []
    original = type(reader._storage).read_data

    def counting(self, plan, planner):
        items.extend(plan.items)
        return original(self, plan, planner)
    monkeypatch.setattr(type(reader._storage), "read_data", counting)
    reader.get("decoder.layers.2.self_attention.linear_qkv.weight")
    assert [list(i.storage_offsets) for i in items] == [[0, 0, 0]] * 2  # two whole saved chunks
    assert [i.storage_index.offset[0] for i in items] == [2, 2]  # both of layer 2


def test_reader_paths_manifest_and_errors(checkpoint, tmp_path):
    from megatron_patch.training.checkpoint import CheckpointError

    root = checkpoint("tp1")
    reader = _reader(root)
    assert reader.path == os.path.join(root, "iter_0000001") and _reader(reader.path).keys() == reader.keys()
    assert reader.manifest["format"] == "torch_dist" and reader.config["num_layers"] == 4 and reader.tied
    assert "output_layer.weight" not in reader and reader.keys()[0] == "embedding.word_embeddings.weight"
    assert not any("_extra_state" in k or "layer_norm_" in k for k in reader.keys())
    with pytest.raises(CheckpointError, match="tied to embedding.word_embeddings.weight"):
        reader.get("output_layer.weight")
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        _reader(str(tmp_path))
    llama = _reader(checkpoint("llama_tp2dp2_zero1_bf16"))
    assert not llama.tied and llama.keys()[-1] == "output_layer.weight"


# ------------------------------------------------------------------------- the reference, in a subprocess


def _build_reference(out: str, flags) -> None:
    """torch.save the state dict (no _extra_state) of the engine's unwrapped TP1 PP1 model, as initialized (its
    process groups started and torn down again, so one process builds several)."""
    from megatron_patch.config import parse_args
    from megatron_patch.parallel import destroy, initialize
    from megatron_patch.training.checkpoint.torch_dist import unwrap
    from megatron_patch.models.build import build_model

    from engine_utils import TINY

    cfg = initialize(parse_args([*TINY, *flags]))
    try:
        model = unwrap(build_model(cfg, cfg.vocab_size)[0])
        torch.save({k: v.clone() for k, v in model.state_dict().items() if "_extra_state" not in k}, out)
    finally:
        destroy()


if __name__ == "__main__":  # the reference fixture: test_conversion_io.py '[[OUT, [engine flags...]], ...]'
    sys.path.insert(0, ROOT)
    for out, flags in json.loads(sys.argv[1]):
        _build_reference(out, [*ONE_ITER, *flags])
