"""Pretraining throughput on one GPU: our engine against Hugging Face, same shape, one command per shape.

Shapes (65,536 tokens per optimizer step; TFLOP/s counts 6N + 12*L*h*s per token; MFU against 989 TFLOP/s):
  llama-1.3b   Llama-style 24 layers, hidden 2048, ffn 5504, 16 heads, seq 2048, vocab 32000, micro batch 8 x 4
  gpt2-124m    GPT-2 12 layers, hidden 768, 12 heads, seq 1024, vocab 50257, micro batch 32 x 2, dropout 0
  llama-1.3b-16k, llama-1.3b-32k  the Llama 1.3B shape at sequence 16,384 (micro batch 1 x 4) and 32,768 (1 x 2)
  llama3-8b    Llama-3-8B whole (32 layers, vocab 128256, GQA), seq 8192, micro batch 1 x 8: one GPU holds it with
               full recompute and bf16 Adam moments (--exp-avg-dtype bf16); HF with --hf-memory-savings
  llama3-8b-layers  Llama-3-8B's layers (hidden 4096, ffn 14336, 32 heads, 8 key/value groups), 4 of them, seq 4096,
               vocab 32000 (not 8B's 128256: the layers are what is measured), micro batch 2 x 8

Systems:
  engine          pretrain_megatron_gpt.py as users run it: bf16 weights, megatron-core's optimizer (fp32 main
                  weights, fused AdamW), SDPA core attention, mock data (random tokens)
  engine+compile  the same with --compile (each transformer layer compiled)
  engine+best     the same with --best-args (default: the shape's fastest flags measured, see BEST_ARGS)
  engine+best+fp8 the same with FP8 GEMMs through torchao: --fp8-format hybrid (tensorwise recipe)
  engine+best+fp8-rowwise  the same with --fp8-format e4m3 --fp8-recipe rowwise
  hf              transformers LlamaForCausalLM / GPT2LMHeadModel, attn_implementation="sdpa", fp32 weights +
                  autocast bf16, torch fused AdamW, clip 1.0
  hf+compile      the same, torch.compile(model)
  hf+liger        the same, eager, with Liger kernels (Llama: RMSNorm, RoPE, SwiGLU, fused linear cross-entropy;
                  GPT-2: LayerNorm and fused linear cross-entropy), liger-kernel from PyPI

    python benchmarks/bench_pretrain.py --shape gpt2-124m [--systems engine hf ...] [--steps 8] [--warmup 3]
Prints one table last (tokens/s, MFU, peak memory, time to first step, graphs compiled after step 2); a JSON
line per system goes to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEAK = 989.0  # dense bf16 TFLOP/s of an H100/H200 SXM
SHAPES = {
    # Llama: micro batch 8 x 4 for every system (engine+best +2.8-3.1% over 4 x 8 on an H100, HF + Liger +7.6%;
    # HF eager then peaks at 75.6 GiB: `--micro-batch 4` on a smaller GPU)
    "llama-1.3b": dict(family="llama", layers=24, hidden=2048, ffn=5504, heads=16, seq=2048, vocab=32000, mbs=8, acc=4),
    # GPT-2: micro batch 32 x 2 for every system (engine+best +3-4% over 16 x 4 on an H100; fewer launches)
    "gpt2-124m": dict(family="gpt", layers=12, hidden=768, ffn=3072, heads=12, seq=1024, vocab=50257, mbs=32, acc=2),
    "llama-1.3b-16k": dict(family="llama", layers=24, hidden=2048, ffn=5504, heads=16, seq=16384, vocab=32000, mbs=1,
                           acc=4),
    "llama-1.3b-32k": dict(family="llama", layers=24, hidden=2048, ffn=5504, heads=16, seq=32768, vocab=32000, mbs=1,
                           acc=2),
    "llama3-8b": dict(family="llama", layers=32, hidden=4096, ffn=14336, heads=32, groups=8, seq=8192, vocab=128256,
                      mbs=1, acc=8, rope_base=500000),
    "llama3-8b-layers": dict(family="llama", layers=4, hidden=4096, ffn=14336, heads=32, groups=8, seq=4096,
                             vocab=32000, mbs=2, acc=8),
}
FP8_ARGS = {"engine+best+fp8": ["--fp8-format", "hybrid"],
            "engine+best+fp8-rowwise": ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"]}
# The fastest flags measured for each shape (RESULTS.md): layers compiled, the Triton cross entropy, weight
# gradients accumulated into the buffer by their GEMM, Adam in one fused kernel launch per param group (+1.0% on
# GPT-2, +1.4% on Llama); GPT-2 also replays its layers as CUDA graphs (host overhead), Llama also keeps bf16
# gradients (reduce-overhead gains nothing there).
def _llama_best(loss_impl: str, *more: str) -> str:
    """The Llama shapes' fastest flags: compiled layers, a fused loss (triton; linear for long sequences: the output
    layer in chunks, no logits), bf16 gradients, fused weight-gradient accumulation and fused Adam; then `more`."""
    return " ".join([f"--compile --cross-entropy-loss-fusion --cross-entropy-fusion-impl {loss_impl} --grad-reduce-in-bf16 "
                     "--gradient-accumulation-fusion --optimizer-step-fusion", *more])


BEST_ARGS = {
    "gpt2-124m": "--compile --compile-mode reduce-overhead --cross-entropy-loss-fusion --cross-entropy-fusion-impl triton "
                 "--gradient-accumulation-fusion --optimizer-step-fusion",
    "llama-1.3b": _llama_best("triton"),
    # long sequences: the loss without the logits; at 32k the first 12 layers recomputed whole (block)
    "llama-1.3b-16k": _llama_best("linear"),
    "llama-1.3b-32k": _llama_best("linear", "--checkpoint-activations --recompute-granularity full "
                                            "--recompute-method block --recompute-num-layers 12"),
    # 8B on one GPU: 16 GB bf16 weights + 16 GB bf16 gradients + 32 GB fp32 main weights + 32 GB bf16 moments
    "llama3-8b": _llama_best("linear", "--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --checkpoint-activations "
                                       "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"),
    "llama3-8b-layers": _llama_best("triton"),
}


def flops_per_token(n_params, s):
    # attention: 12*L*h*s counts causal attention as full (Megatron-LM's and our log's convention)
    return 6 * n_params + 12 * s["layers"] * s["hidden"] * s["seq"]


def run_engine(a, s, name: str, extra: list):
    """`a.extra_steps` (optional): iterations after the timed ones, run but not timed (profiled ones)."""
    extra_steps = getattr(a, "extra_steps", 0)
    iters = a.warmup + a.steps + extra_steps
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_megatron_gpt.py"), "--model-family", s["family"], "--mock-data",
           "--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"]), "--ffn-hidden-size", str(s["ffn"]),
           "--num-attention-heads", str(s["heads"]), "--seq-length", str(s["seq"]), "--vocab-size", str(s["vocab"]),
           "--max-position-embeddings", str(s["seq"]), "--hidden-dropout", "0", "--attention-dropout", "0",
           "--micro-batch-size", str(s["mbs"]), "--global-batch-size", str(s["mbs"] * s["acc"]),
           "--train-iters", str(iters), "--lr", "1e-4", "--lr-warmup-iters", "1", "--bf16", "--eval-iters", "0",
           "--log-interval", str(iters), "--attention-backend", "sdpa", "--make-vocab-size-divisible-by", "128"] + (
           ["--num-query-groups", str(s["groups"])] if s.get("groups") else []) + (
           ["--rotary-base", str(s["rope_base"])] if s.get("rope_base") else []) + extra
    return run_measured(name, cmd, a.warmup, extra, extra_steps)


def run_measured(name: str, cmd: list, warmup: int, extra: list, extra_steps: int = 0) -> dict:
    """Runs an engine command line (its --train-iters and the data flags set by the caller) with a metrics file,
    and returns the mean step time after `warmup` steps, the losses of every step, peak GPU memory, time from
    launch to the end of step 1 and the graphs dynamo built after step 2; or {"system", "error"}."""
    metrics = tempfile.mktemp(suffix=".jsonl")
    cmd = cmd + ["--metrics-file", metrics]
    t = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        return {"system": name, "error": proc.stderr[-1500:]}
    lines = [json.loads(x) for x in open(metrics) if '"loss"' in x]
    times = [x["step_time"] for x in lines][warmup:len(lines) - extra_steps]
    graphs = [x.get("compiled_graphs", 0) for x in lines]
    return {"system": name, "step_s": sum(times) / len(times), "params": lines[0]["num_params"],
            "loss_first": lines[0]["loss"], "loss_last": lines[-1]["loss"], "losses": [x["loss"] for x in lines],
            "wall_s": time.time() - t, "first_step_s": lines[0]["wall_time"] - t,
            "peak_gib": max(x.get("max_memory_bytes", 0) for x in lines) / 2**30,
            "graphs": graphs[-1], "graphs_after_step2": graphs[-1] - graphs[min(1, len(graphs) - 1)], "flags": extra,
            "log": [ln for ln in proc.stdout.splitlines()
                    if ln.startswith(("model", "iteration", "torch.compile", "gradient accumulation", "MoE grouped",
                                      "GPU time", "  "))]}


def _hf_model(s, liger: bool):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if s["family"] == "llama":
        if liger:
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama(rope=True, swiglu=True, rms_norm=True, cross_entropy=False,
                                        fused_linear_cross_entropy=True)
        cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                          num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                          num_key_value_heads=s.get("groups", s["heads"]), max_position_embeddings=s["seq"], tie_word_embeddings=False, attn_implementation="sdpa")
        return LlamaForCausalLM(cfg).cuda()
    cfg = GPT2Config(vocab_size=s["vocab"], n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"],
                     n_positions=s["seq"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     attn_implementation="sdpa")
    model = GPT2LMHeadModel(cfg).cuda()
    if liger:  # Liger has no GPT-2 patch: its LayerNorm modules, and its fused linear cross-entropy below
        from liger_kernel.transformers import LigerLayerNorm

        for block in list(model.transformer.h) + [model.transformer]:
            for attr in ("ln_1", "ln_2", "ln_f"):
                ln = getattr(block, attr, None)
                if ln is not None:
                    new = LigerLayerNorm(s["hidden"], eps=ln.eps).cuda()
                    new.load_state_dict(ln.state_dict())
                    setattr(block, attr, new)
    return model


def run_hf(a, s, name: str):
    import torch

    t0 = time.time()
    liger = name == "hf+liger"
    model = _hf_model(s, liger)
    n = sum(p.numel() for p in model.parameters())
    if a.hf_memory_savings:  # bf16 weights, gradients and AdamW state (no fp32 master copy), layers recomputed
        model.to(torch.bfloat16)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(model) if name == "hf+compile" else model
    flce = None
    if liger and s["family"] == "gpt":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        flce = LigerFusedLinearCrossEntropyLoss()

    def loss_of(x):
        if flce is None:
            return fwd(input_ids=x, labels=x).loss
        h = model.transformer(input_ids=x).last_hidden_state[:, :-1]
        return flce(model.lm_head.weight, h.reshape(-1, h.size(-1)), x[:, 1:].reshape(-1))

    def step():
        for _ in range(s["acc"]):
            x = torch.randint(0, s["vocab"], (s["mbs"], s["seq"]), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_of(x) / s["acc"]
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item() * s["acc"]

    first = step()
    first_step_s = time.time() - t0
    for _ in range(a.warmup - 1):
        step()
    torch.cuda.synchronize()
    t = time.time()
    for _ in range(a.steps):
        last = step()
    torch.cuda.synchronize()
    return {"system": name, "step_s": (time.time() - t) / a.steps, "params": n, "loss_first": first,
            "loss_last": last, "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "first_step_s": first_step_s}


def run_one(a, s, name: str):
    if name.startswith("engine"):
        best = shlex.split(a.best_args)
        extra = {"engine": [], "engine+compile": ["--compile"], "engine+best": best,
                 **{k: best + v for k, v in FP8_ARGS.items()}}[name]
        return run_engine(a, s, name, extra + a.engine_args)
    return run_hf(a, s, name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1.3b")
    p.add_argument("--systems", nargs="+", default=["engine", "engine+best", "hf", "hf+compile", "hf+liger"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, help="override the shape's layer count (quick trials)")
    p.add_argument("--micro-batch", type=int, help="override the shape's micro batch size for every system; the "
                   "accumulation steps change so that the tokens per optimizer step stay the same")
    p.add_argument("--best-args", help="flags of engine+best, one string (default: the shape's fastest measured, "
                                        + "; ".join(f"{k}: {v}" for k, v in BEST_ARGS.items()) + ")")
    p.add_argument("--hf-memory-savings", action="store_true", help="HF systems in bf16 (weights, gradients, AdamW "
                   "state) with gradient checkpointing: what fits an 8B model or a long sequence on one GPU")
    p.add_argument("--engine-args", nargs=argparse.REMAINDER, default=[], help="added to every engine run")
    p.add_argument("--out", default="bench_pretrain.jsonl")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # one HF system, in a subprocess
    a = p.parse_args()
    s = dict(SHAPES[a.shape])
    if a.best_args is None:
        a.best_args = BEST_ARGS[a.shape]
    if a.layers:
        s["layers"] = a.layers
    if a.micro_batch:
        total = s["mbs"] * s["acc"]
        if total % a.micro_batch:
            p.error(f"--micro-batch {a.micro_batch} does not divide the shape's {total} sequences per step")
        s["mbs"], s["acc"] = a.micro_batch, total // a.micro_batch
    tokens = s["mbs"] * s["acc"] * s["seq"]
    rows = []
    for name in a.systems:
        # each HF system in its own process: Liger patches transformers' classes, and memory peaks stay apart
        if name.startswith("hf") and not a.inner:
            r = _subprocess_hf(a, name)
        else:
            r = run_one(a, s, name)
        rows.append(r)
        with open(a.out, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)
    if a.inner:
        return
    import torch

    print(f"\n{torch.cuda.get_device_name()} | {a.shape}: {s['layers']}L h{s['hidden']} ffn{s['ffn']} seq{s['seq']} "
          f"vocab{s['vocab']} | micro batch {s['mbs']} x {s['acc']} | {tokens} tokens/step")
    print(f"{'system':<23} | {'tokens/s':>9} | {'TFLOP/s':>7} | {'MFU':>6} | {'vs best HF':>10} | {'vs engine+best':>14} | "
          f"{'peak GiB':>8} | "
          f"{'1st step s':>10} | {'recompiles':>10} | loss first -> last")
    ok = [r for r in rows if "step_s" in r]
    base = min((r for r in ok if r["system"].startswith("hf")), key=lambda r: r["step_s"], default=None)
    best = next((r for r in ok if r["system"] == "engine+best"), None)
    for r in rows:
        if "step_s" not in r:
            print(f"{r['system']:<23} | FAILED: {r['error'][-300:]}")
            continue
        tps = tokens / r["step_s"]
        tf = tps * flops_per_token(r["params"], s) / 1e12
        ratio = f"{(base['step_s'] / r['step_s']):.2f}x" if base else "n/a"
        vs_best = f"{(best['step_s'] / r['step_s']):.3f}x" if best else "n/a"
        print(f"{r['system']:<23} | {tps:9.0f} | {tf:7.1f} | {100 * tf / PEAK:5.1f}% | {ratio:>10} | {vs_best:>14} | "
              f"{r['peak_gib']:8.1f} | {r['first_step_s']:10.1f} | {str(r.get('graphs_after_step2', '-')):>10} | "
              f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}")


def _subprocess_hf(a, name: str) -> dict:
    out = tempfile.mktemp(suffix=".jsonl")
    cmd = [sys.executable, os.path.abspath(__file__), "--inner", "--shape", a.shape, "--systems", name,
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--out", out] + (
           ["--hf-memory-savings"] if a.hf_memory_savings else []) + (["--layers", str(a.layers)] if a.layers else []) + (
           ["--micro-batch", str(a.micro_batch)] if a.micro_batch else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        return {"system": name, "error": proc.stderr[-1500:]}
    return json.loads(open(out).read().splitlines()[-1])


if __name__ == "__main__":
    main()
