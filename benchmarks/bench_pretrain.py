"""Pretraining throughput on one GPU: our engine against Hugging Face's LlamaForCausalLM, same shape.

Shape (the DESIGN anchor): Llama-style 24 layers, hidden 2048, ffn 5504, 16 heads, seq 2048, vocab 32000;
65,536 tokens per optimizer step (micro batch 4 x 8 accumulation). TFLOP/s counts 6N + 12*L*h*s per token.

  engine          pretrain_megatron_gpt.py as users run it: bf16 weights, megatron-core's optimizer
                  (fp32 main weights, fused AdamW), SDPA core attention, mock data (random tokens)
  engine+compile  the same with --compile
  hf / hf+compile transformers LlamaForCausalLM, attn_implementation="sdpa", fp32 weights + autocast bf16,
                  torch fused AdamW, clip 1.0 (the anchor measured in DESIGN.md)

    python benchmarks/bench_pretrain.py [--systems engine hf ...] [--steps 8] [--warmup 3] [--layers 24]
Prints one table last; a JSON line per system goes to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEAK = 989.0  # dense bf16 TFLOP/s of an H100/H200 SXM


def shape(a):
    return dict(layers=a.layers, hidden=2048, ffn=5504, heads=16, seq=2048, vocab=32000, mbs=4, acc=8)


def flops_per_token(n_params, s):
    return 6 * n_params + 12 * s["layers"] * s["hidden"] * s["seq"]


def run_engine(a, s, compile_: bool):
    metrics = tempfile.mktemp(suffix=".jsonl")
    iters = a.warmup + a.steps
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_megatron_gpt.py"), "--model-family", "llama", "--mock-data",
           "--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"]), "--ffn-hidden-size", str(s["ffn"]),
           "--num-attention-heads", str(s["heads"]), "--seq-length", str(s["seq"]), "--vocab-size", str(s["vocab"]),
           "--micro-batch-size", str(s["mbs"]), "--global-batch-size", str(s["mbs"] * s["acc"]),
           "--train-iters", str(iters), "--lr", "1e-4", "--lr-warmup-iters", "1", "--bf16", "--eval-iters", "0",
           "--log-interval", str(iters), "--metrics-file", metrics, "--attention-backend", "sdpa",
           "--make-vocab-size-divisible-by", "128"] + (["--compile"] if compile_ else []) + a.engine_args
    t = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        return {"system": "engine" + ("+compile" if compile_ else ""), "error": proc.stderr[-1500:]}
    lines = [json.loads(x) for x in open(metrics) if '"loss"' in x]
    times = [x["step_time"] for x in lines][a.warmup:]
    n = lines[0]["num_params"]
    return {"system": "engine" + ("+compile" if compile_ else ""), "step_s": sum(times) / len(times), "params": n,
            "loss_first": lines[0]["loss"], "loss_last": lines[-1]["loss"], "wall_s": time.time() - t,
            "log": [l for l in proc.stdout.splitlines() if l.startswith(("model", "iteration"))][-2:]}


def run_hf(a, s, compile_: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], max_position_embeddings=s["seq"],
                      tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).cuda()
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(model) if compile_ else model

    def step():
        for _ in range(s["acc"]):
            x = torch.randint(0, s["vocab"], (s["mbs"], s["seq"]), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fwd(input_ids=x, labels=x).loss / s["acc"]
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item() * s["acc"]

    for _ in range(a.warmup):
        first = step()
    torch.cuda.synchronize()
    t = time.time()
    for _ in range(a.steps):
        last = step()
    torch.cuda.synchronize()
    out = {"system": "hf" + ("+compile" if compile_ else ""), "step_s": (time.time() - t) / a.steps, "params": n,
           "loss_first": first, "loss_last": last, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    return out  # the model and optimizer go with this frame


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", nargs="+", default=["engine", "engine+compile", "hf", "hf+compile"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--engine-args", nargs=argparse.REMAINDER, default=[])
    p.add_argument("--out", default="bench_pretrain.jsonl")
    a = p.parse_args()
    s = shape(a)
    tokens = s["mbs"] * s["acc"] * s["seq"]
    rows = []
    for name in a.systems:
        compile_ = name.endswith("+compile")
        r = run_engine(a, s, compile_) if name.startswith("engine") else run_hf(a, s, compile_)
        rows.append(r)
        with open(a.out, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)
    import torch

    print(f"\n{torch.cuda.get_device_name()} | Llama {s['layers']}L h{s['hidden']} ffn{s['ffn']} seq{s['seq']} "
          f"vocab{s['vocab']} | {tokens} tokens/step")
    print(f"{'system':<16} | {'tokens/s':>9} | {'TFLOP/s':>7} | {'MFU':>6} | {'vs hf+compile':>13} | loss first -> last")
    base = next((r for r in rows if r.get("system") == "hf+compile" and "step_s" in r), None)
    for r in rows:
        if "step_s" not in r:
            print(f"{r['system']:<16} | FAILED: {r['error'][-300:]}")
            continue
        tps = tokens / r["step_s"]
        tf = tps * flops_per_token(r["params"], s) / 1e12
        ratio = f"{(base['step_s'] / r['step_s']):.2f}x" if base else "n/a"
        print(f"{r['system']:<16} | {tps:9.0f} | {tf:7.1f} | {100 * tf / PEAK:5.1f}% | {ratio:>13} | "
              f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}")


if __name__ == "__main__":
    main()
