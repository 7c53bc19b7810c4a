"""Mixture of experts on one GPU: a Mixtral-style model against the dense model of the same active parameters.

Shape: Llama-style 12 layers, hidden 1024, 16 heads (8 KV groups), seq 2048, vocab 32000; the MoE model has 8
experts of ffn 1792 per layer, top-2 routing (aux loss 0.01, alltoall dispatcher), so each token passes through
2 x 1792 = 3584 ffn units, which is the dense model's ffn. 65,536 tokens per optimizer step (micro batch 4 x 8).
TFLOP/s counts 6 x active parameters + 12*L*h*s per token (router and permutation work not counted).

  engine-dense  pretrain_megatron_gpt.py, llama family, ffn 3584 (bf16, mock data, SDPA)
  engine-moe    the same with --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 1792
                (megatron-core MoELayer: SequentialMLP experts, no grouped GEMM without Transformer Engine)
  engine-moe-grouped  the same with --moe-grouped-gemm (the experts as two torch._grouped_mm calls)
  hf-moe        transformers MixtralForCausalLM of the same shape (SDPA, fp32 weights + autocast bf16,
                fused AdamW), the anchor

    python benchmarks/bench_moe.py [--systems engine-dense engine-moe engine-moe-grouped hf-moe] [--steps 8] [--warmup 3]
        [--profile-dir DIR] [--engine-args --compile --grad-reduce-in-bf16]
Prints one table last (tokens/s, MFU on active parameters, peak memory, ratios).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pretrain import PEAK, run_engine  # noqa: E402

EXPERTS, TOPK, MOE_FFN = 8, 2, 1792
PROFILED = 2  # iterations under torch.profiler with --profile-dir


def shape(a, moe: bool):
    return dict(family="llama", layers=a.layers, hidden=1024, ffn=MOE_FFN if moe else TOPK * MOE_FFN, heads=16, groups=8, seq=2048,
                vocab=32000, mbs=4, acc=8)


def inactive_params(s) -> int:
    """Expert weights a token does not pass through: (E - k) experts of 3 matrices (gate, up, down) per layer."""
    return s["layers"] * (EXPERTS - TOPK) * 3 * s["hidden"] * MOE_FFN


def engine(a, name: str):
    moe = name.startswith("engine-moe")
    s = shape(a, moe)
    extra = []  # (run_engine passes the shape's --num-query-groups)
    if moe:
        extra += ["--num-experts", str(EXPERTS), "--moe-router-topk", str(TOPK), "--moe-ffn-hidden-size", str(MOE_FFN),
                  "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall"]
    if name == "engine-moe-grouped":
        extra.append("--moe-grouped-gemm")
    profile = []
    if a.profile_dir:  # two more iterations, profiled after the timed ones (run_measured leaves them out)
        end = a.warmup + a.steps + PROFILED
        profile = ["--profile", "--profile-step-start", str(end - PROFILED), "--profile-step-end", str(end),
                   "--profile-dir", os.path.join(a.profile_dir, name)]
    r = run_engine(types.SimpleNamespace(warmup=a.warmup, steps=a.steps, extra_steps=PROFILED if profile else 0),
                   s, name, extra + a.engine_args + profile)
    if "params" in r:
        r["active"] = r["params"] - (inactive_params(s) if moe else 0)
    return r


def hf_moe(a):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    s = shape(a, True)
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=MOE_FFN,
                        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["groups"],
                        num_local_experts=EXPERTS, num_experts_per_tok=TOPK, max_position_embeddings=s["seq"],
                        router_aux_loss_coef=0.01, output_router_logits=True, tie_word_embeddings=False,
                        attn_implementation="sdpa")
    model = MixtralForCausalLM(cfg).cuda()
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    torch.cuda.reset_peak_memory_stats()

    def step():
        for _ in range(s["acc"]):
            x = torch.randint(0, s["vocab"], (s["mbs"], s["seq"]), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss / s["acc"]
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item() * s["acc"]

    t0 = time.time()
    first = step()
    first_s = time.time() - t0
    for _ in range(a.warmup - 1):
        step()
    torch.cuda.synchronize()
    t = time.time()
    for _ in range(a.steps):
        last = step()
    torch.cuda.synchronize()
    out = {"system": "hf-moe", "step_s": (time.time() - t) / a.steps, "params": n, "active": n - inactive_params(s),
           "loss_first": first, "loss_last": last, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
           "first_step_s": first_s}
    return out  # the model and optimizer go with this frame


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", nargs="+", default=["engine-dense", "engine-moe", "engine-moe-grouped", "hf-moe"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--engine-args", nargs=argparse.REMAINDER, default=[])
    p.add_argument("--out", default="bench_moe.jsonl")
    p.add_argument("--profile-dir", help="engine systems: 2 more iterations under torch.profiler after the timed ones; "
                   "DIR/SYSTEM/breakdown.json (GPU time by kind, idle share, every kernel) and a Chrome trace")
    a = p.parse_args()
    rows = []
    for name in a.systems:
        r = hf_moe(a) if name == "hf-moe" else engine(a, name)
        rows.append(r)
        with open(a.out, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)
    import torch

    s = shape(a, True)
    tokens = s["mbs"] * s["acc"] * s["seq"]
    print(f"\n{torch.cuda.get_device_name()} | {s['layers']}L h{s['hidden']} seq{s['seq']} vocab{s['vocab']} | "
          f"MoE {EXPERTS} experts x ffn {MOE_FFN}, top-{TOPK} vs dense ffn {TOPK * MOE_FFN} | {tokens} tokens/step")
    print(f"{'system':<18} | {'params':>7} | {'active':>7} | {'tokens/s':>9} | {'MFU':>6} | {'peak GiB':>8} | "
          f"{'vs engine-dense':>15} | {'vs hf-moe':>9} | loss first -> last")
    by = {r["system"]: r for r in rows if "step_s" in r}
    for r in rows:
        if "step_s" not in r:
            print(f"{r['system']:<18} | FAILED: {r.get('error', '')[-300:]}")
            continue
        tps = tokens / r["step_s"]
        mfu = tps * (6 * r["active"] + 12 * s["layers"] * s["hidden"] * s["seq"]) / 1e12 / PEAK
        ratio = lambda k: f"{by[k]['step_s'] / r['step_s']:.2f}x" if k in by else "n/a"  # noqa: E731
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "n/a"
        print(f"{r['system']:<18} | {r['params'] / 1e6:6.0f}M | {r['active'] / 1e6:6.0f}M | {tps:9.0f} | "
              f"{100 * mfu:5.1f}% | {peak:>8} | {ratio('engine-dense'):>15} | {ratio('hf-moe'):>9} | "
              f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}")


if __name__ == "__main__":
    main()
