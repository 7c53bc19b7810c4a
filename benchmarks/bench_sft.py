"""Supervised fine-tuning on one GPU: packed against padded samples, the engine's LoRA against Hugging Face + peft,
and the memory of LoRA against full fine-tuning. One command, one table per part, side by side in one run.

Data: chat-like conversations with token ids at random (lengths log-normal, median 320 tokens, 32 to --seq tokens,
the first 40% of each a prompt outside the loss), written in preprocess_data.py --sft's format. "Real" tokens are
the conversations' own (padding excluded); each system's real tokens/s counts exactly the conversations its measured
steps trained on (the engine's sample order is rebuilt here from the same dataset code, seed and split).

Systems:
  engine_padded     pretrain_megatron_gpt.py --sft --no-pack-sequences: one conversation per --seq sample, bf16
  engine_packed     --sft: conversations packed into --seq samples (best-fit decreasing), varlen flash attention
  engine_lora       engine_packed + --lora-rank 16 --lora-alpha 32 on every linear (base frozen, bf16)
  hf_lora           transformers LlamaForCausalLM in bf16 + peft LoRA (same rank, alpha, targets), SDPA attention,
                    micro batches of conversations padded to their longest (DataCollatorForSeq2Seq's way), fused AdamW
  hf_lora_sorted    the same with length-grouped micro batches (Trainer's group_by_length): less padding
Memory (--memory): the engine's peak GPU memory, full fine-tuning (bf16 weights, fp32 main weights and Adam) against
LoRA, for the shape and for an 8B-layer-shaped model (Llama-3-8B's layers and vocabulary, --memory-layers of them).

    python benchmarks/bench_sft.py [--shape llama-1.3b] [--systems ...] [--steps 20] [--warmup 5] [--memory]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHAPES = {
    "llama-1.3b": dict(layers=24, hidden=2048, ffn=5504, heads=16, groups=16, vocab=32000, seq=2048),
    "llama3-8b-layers": dict(layers=8, hidden=4096, ffn=14336, heads=32, groups=8, vocab=128256, seq=2048),
    "tiny": dict(layers=2, hidden=64, ffn=128, heads=4, groups=2, vocab=512, seq=256),  # a CPU check of the script
}
LORA = ["--lora-rank", "16", "--lora-alpha", "32"]
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SAMPLES_PER_STEP = 16  # conversations (padded, HF) or packed samples per optimizer step


def write_data(path: str, vocab: int, seq: int, count: int, seed: int = 0) -> str:
    """Conversations with random ids and a chat-like length spread; returns the --data-path prefix."""
    from megatron_patch.data.indexed_dataset import IndexedDatasetWriter

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(320), 0.8, count).astype(int), 32, seq)
    with IndexedDatasetWriter(f"{path}_text_document", np.int32) as tokens, \
            IndexedDatasetWriter(f"{path}_loss_mask_document", np.uint8) as masks:
        for n in lengths:
            tokens.add_document([rng.integers(0, vocab - 1, n)])
            mask = np.zeros(n, np.uint8)
            mask[int(0.4 * n):] = 1
            masks.add_document([mask])
        tokens.finalize()
        masks.finalize()
    return f"{path}_text_document"


def engine_real_tokens(prefix: str, seq: int, pack: bool, gbs: int, first: int, last: int) -> int:
    """Real tokens of the engine's global batches [first, last) (its sample order, rebuilt)."""
    from megatron_patch.data.sft_dataset import build_sft_datasets

    ds = build_sft_datasets(prefix, seq, (last * gbs, 1, 1), "100,0,0", 1234, pack, 0)[0]
    return int(sum(ds.lengths[ds.documents.searchsorted(d)] for i in range(first * gbs, last * gbs)
                   for d in ds.conversations(i)))


def run_engine(a, s, name: str, prefix: str, extra: list) -> dict:
    pack = name != "engine_padded"
    mbs = a.micro_batch
    iters = a.warmup + a.steps
    metrics = tempfile.mktemp(suffix=".jsonl")
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_megatron_gpt.py"), "--model-family", "llama",
           "--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"]), "--ffn-hidden-size", str(s["ffn"]),
           "--num-attention-heads", str(s["heads"]), "--num-query-groups", str(s["groups"]),
           "--seq-length", str(s["seq"]), "--max-position-embeddings", str(s["seq"]), "--tokenizer-type",
           "NullTokenizer", "--vocab-size", str(s["vocab"]), "--data-path", prefix, "--sft", "--split", "100,0,0",
           "--micro-batch-size", str(mbs), "--global-batch-size", str(SAMPLES_PER_STEP), "--train-iters", str(iters),
           "--lr", "1e-4", "--lr-warmup-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
           "--eval-iters", "0", "--log-interval", str(iters), "--attention-backend", "sdpa", "--seed", "1234",
           "--metrics-file", metrics] + ([] if pack else ["--no-pack-sequences"]) + \
        (["--bf16"] if a.device == "cuda" else []) + extra
    t = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        return {"system": name, "error": (proc.stdout + proc.stderr)[-2000:]}
    lines = [json.loads(x) for x in open(metrics) if '"loss"' in x]
    step = sum(x["step_time"] for x in lines[a.warmup:]) / a.steps
    real = engine_real_tokens(prefix, s["seq"], pack, SAMPLES_PER_STEP, a.warmup, iters) / a.steps
    return {"system": name, "step_s": step, "real_tokens_per_step": real, "real_tokens_s": real / step,
            "padded_tokens_per_step": SAMPLES_PER_STEP * s["seq"],
            "peak_gib": max(x.get("max_memory_bytes", 0) for x in lines) / 2**30, "wall_s": time.time() - t,
            "loss_first": lines[0]["loss"], "loss_last": lines[-1]["loss"], "flags": extra,
            "log": [ln for ln in proc.stdout.splitlines() if ln.startswith(("model", "LoRA", "iteration"))]}


def run_hf(a, s, name: str, prefix: str) -> dict:
    """Hugging Face + peft LoRA on the same conversations (random order, or length-grouped), padded per batch."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_patch.data.sft_dataset import open_sft

    torch.manual_seed(0)
    dev = a.device
    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["groups"],
                      max_position_embeddings=s["seq"], tie_word_embeddings=False, attn_implementation="sdpa")
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = LlamaForCausalLM(cfg).to(dev, dtype)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=HF_TARGETS, lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=dev == "cuda")
    tokens, masks = open_sft(prefix)
    rng = np.random.default_rng(0)
    order = rng.permutation(tokens.num_documents)
    per_step = a.hf_conversations_per_step
    steps = a.warmup + a.steps
    batches = [order[i * per_step:(i + 1) * per_step] for i in range(steps)]
    mbs = a.hf_micro_batch
    if name == "hf_lora_sorted":  # group_by_length: each step's conversations in micro batches of similar length
        batches = [b[np.argsort(tokens.sequence_lengths[b])] for b in batches]

    def micro(docs):
        n = int(max(tokens.sequence_lengths[docs]))
        ids = torch.zeros(len(docs), n, dtype=torch.long)
        labels = torch.full((len(docs), n), -100, dtype=torch.long)
        attn = torch.zeros(len(docs), n, dtype=torch.long)
        for r, d in enumerate(docs):
            t, m = torch.from_numpy(tokens[d].astype(np.int64)), torch.from_numpy(masks[d].astype(np.int64))
            ids[r, :len(t)], attn[r, :len(t)] = t, 1
            labels[r, :len(t)] = torch.where(m.bool(), t, torch.full_like(t, -100))
        return ids.to(dev), labels.to(dev), attn.to(dev)

    def step(docs):
        count, total = sum(int(masks[d][1:].sum()) for d in docs), 0.0
        for i in range(0, len(docs), mbs):
            ids, labels, attn = micro(docs[i:i + mbs])
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                logits = model(input_ids=ids, attention_mask=attn).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                     labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
            (loss / count).backward()  # per token over the step, as the engine
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total) / count

    first = step(batches[0])
    for b in batches[1:a.warmup]:
        step(b)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    sync()
    t = time.time()
    for b in batches[a.warmup:]:
        last = step(b)
    sync()
    dt = (time.time() - t) / a.steps
    real = sum(int(tokens.sequence_lengths[b].sum()) for b in batches[a.warmup:]) / a.steps
    padded = sum(int(max(tokens.sequence_lengths[b[i:i + mbs]])) * len(b[i:i + mbs]) for b in batches[a.warmup:]
                 for i in range(0, len(b), mbs)) / a.steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else 0.0
    return {"system": name, "step_s": dt, "real_tokens_per_step": real, "real_tokens_s": real / dt,
            "padded_tokens_per_step": padded, "peak_gib": peak, "loss_first": first, "loss_last": last}


def memory_rows(a, prefix_of) -> list:
    rows = []
    for shape in (a.shape, "llama3-8b-layers") if a.device == "cuda" else (a.shape,):
        s = dict(SHAPES[shape])
        if shape == "llama3-8b-layers":
            s["layers"] = a.memory_layers
        prefix = prefix_of(s)
        for name, extra in (("full", []), ("lora", LORA)):
            mem_args = argparse.Namespace(**{**vars(a), "steps": 2, "warmup": 1, "micro_batch": 1})
            r = run_engine(mem_args, s, "engine_packed", prefix, extra)
            rows.append({"shape": shape, "layers": s["layers"], "mode": name, **r})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1.3b")
    p.add_argument("--systems", nargs="+", default=["engine_padded", "engine_packed", "engine_lora", "hf_lora",
                                                    "hf_lora_sorted"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--micro-batch", type=int, default=2, help="the engine's samples per micro batch")
    p.add_argument("--hf-micro-batch", type=int, default=8, help="Hugging Face's conversations per micro batch")
    p.add_argument("--hf-conversations-per-step", type=int, default=64,
                   help="Hugging Face's conversations per optimizer step (default: about the real tokens of the "
                        "engine's 16 packed samples of 2048)")
    p.add_argument("--engine-args", nargs="*", default=[], help="added to the engine's LoRA run (e.g. --compile)")
    p.add_argument("--memory", action="store_true", help="also the memory of full fine-tuning against LoRA")
    p.add_argument("--memory-layers", type=int, default=8, help="layers of the 8B-layer-shaped memory model")
    p.add_argument("--conversations", type=int, default=4000)
    p.add_argument("--out", default="bench_sft.jsonl")
    p.add_argument("--inner", help=argparse.SUPPRESS)  # one HF system in its own process: JSON to this file
    a = p.parse_args()
    import torch

    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    s = SHAPES[a.shape]
    work = tempfile.mkdtemp(prefix="bench_sft_")
    prefixes = {}

    def prefix_of(shape):
        key = (shape["vocab"], shape["seq"])
        if key not in prefixes:
            prefixes[key] = write_data(os.path.join(work, f"chat_{key[0]}_{key[1]}"), *key, a.conversations)
        return prefixes[key]

    if a.inner:
        name, prefix = a.systems[0], prefix_of(s)
        with open(a.inner, "w") as f:
            json.dump(run_hf(a, s, name, prefix), f)
        return
    prefix = prefix_of(s)
    rows = []
    for name in a.systems:
        if name.startswith("hf"):  # its own process: memory peaks stay apart
            out = tempfile.mktemp(suffix=".json")
            cmd = [sys.executable, os.path.abspath(__file__), "--inner", out, "--shape", a.shape, "--systems", name,
                   "--steps", str(a.steps), "--warmup", str(a.warmup), "--hf-micro-batch", str(a.hf_micro_batch),
                   "--hf-conversations-per-step", str(a.hf_conversations_per_step),
                   "--conversations", str(a.conversations)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            r = json.load(open(out)) if proc.returncode == 0 else {"system": name, "error": proc.stderr[-2000:]}
        else:
            r = run_engine(a, s, name, prefix, (LORA + a.engine_args) if name == "engine_lora" else [])
        rows.append(r)
        with open(a.out, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps({k: v for k, v in r.items() if k != "log"}), flush=True)
    memory = memory_rows(a, prefix_of) if a.memory else []
    for r in memory:
        with open(a.out, "a") as f:
            f.write(json.dumps(r) + "\n")
    device = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    print(f"\n{device} | {a.shape}: {s['layers']}L h{s['hidden']} ffn{s['ffn']} seq{s['seq']} vocab{s['vocab']} | "
          f"{SAMPLES_PER_STEP} samples (engine) / {a.hf_conversations_per_step} conversations (HF) per step, "
          f"{a.conversations} conversations")
    print(f"{'system':<16} | {'real tok/s':>10} | {'step s':>7} | {'real/padded':>11} | {'peak GiB':>8} | loss first -> last")
    ok = {r["system"]: r for r in rows if "step_s" in r}
    for r in rows:
        if "step_s" not in r:
            print(f"{r['system']:<16} | FAILED: {r['error'][-400:]}")
            continue
        print(f"{r['system']:<16} | {r['real_tokens_s']:10.0f} | {r['step_s']:7.3f} | "
              f"{r['real_tokens_per_step'] / r['padded_tokens_per_step']:10.0%} | {r['peak_gib']:8.1f} | "
              f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}")
    if "engine_packed" in ok and "engine_padded" in ok:
        print(f"packed / padded real tokens/s: {ok['engine_packed']['real_tokens_s'] / ok['engine_padded']['real_tokens_s']:.2f}x")
    hf = [r for n, r in ok.items() if n.startswith("hf")]
    if "engine_lora" in ok and hf:
        best = max(hf, key=lambda r: r["real_tokens_s"])
        print(f"engine LoRA / best HF + peft ({best['system']}): {ok['engine_lora']['real_tokens_s'] / best['real_tokens_s']:.2f}x")
    if memory:
        print(f"\n{'memory shape':<18} | {'layers':>6} | {'mode':<5} | {'peak GiB':>8}")
        for r in memory:
            peak = f"{r['peak_gib']:8.1f}" if "peak_gib" in r else "FAILED: " + r.get("error", "")[-200:]
            print(f"{r['shape']:<18} | {r['layers']:>6} | {r['mode']:<5} | {peak}")


if __name__ == "__main__":
    main()
