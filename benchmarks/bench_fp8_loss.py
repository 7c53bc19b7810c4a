"""FP8 against bf16 on real text: the same Llama-1.3B-shaped run (24 layers, hidden 2048, seq 2048, micro batch 8,
16,384 tokens a step, lr 3e-4 cosine after 30 warm-up steps) twice from the same initialisation and data order, with
the engine's fastest flags (bench_pretrain.py's BEST_ARGS), once with FP8 GEMMs; both loss curves in one PNG
(tools/plot_metrics.py) and a table last: the loss at the end (mean of the last 20 steps), their relative
difference, tokens/s after the first 10 steps, and the ratio.

The corpus: benchmarks/prepare_real_text.sh OUTDIR (docstrings and comments of installed packages, 20M+ tokens,
a byte-level BPE trained on it).

    python benchmarks/bench_fp8_loss.py --data-dir data/real_text [--steps 300] [--fp8-args "--fp8-format hybrid"]
        [--out-dir benchmarks/fp8_loss] [--png benchmarks/fp8_loss.png] [--layers 24]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_pretrain import BEST_ARGS  # noqa: E402


def engine_command(a, metrics: str, extra: list) -> list:
    d = a.data_dir
    return [sys.executable, os.path.join(ROOT, "pretrain_megatron_gpt.py"), "--model-family", "llama",
            "--num-layers", str(a.layers), "--hidden-size", "2048", "--ffn-hidden-size", "5504",
            "--num-attention-heads", "16", "--seq-length", "2048", "--max-position-embeddings", "2048",
            "--micro-batch-size", "8", "--global-batch-size", "8", "--train-iters", str(a.steps),
            "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "30",
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--bf16", "--attention-backend", "sdpa",
            "--data-path", os.path.join(d, "real_text_text_document"), "--split", "98,2,0",
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(d, "gpt2-vocab.json"),
            "--merge-file", os.path.join(d, "gpt2-merges.txt"), "--make-vocab-size-divisible-by", "128",
            "--eval-iters", "0", "--log-interval", "10", "--seed", "1234", "--metrics-file", metrics,
            *shlex.split(BEST_ARGS["llama-1.3b"]), *extra]


def run(a, name: str, extra: list) -> dict:
    os.makedirs(a.out_dir, exist_ok=True)
    metrics = os.path.join(a.out_dir, f"{name}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    log = os.path.join(a.out_dir, f"{name}.log")
    t = time.time()
    with open(log, "w") as f:
        proc = subprocess.run(engine_command(a, metrics, extra), stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        return {"name": name, "error": open(log).read()[-2000:]}
    lines = [json.loads(x) for x in open(metrics) if '"loss"' in x]
    steady = [x for x in lines if x["iteration"] > 10]
    times = [x["step_time"] for x in steady if "step_time" in x]
    tps = 16384 * len(times) / sum(times) if times else None
    last = [x["loss"] for x in lines[-20:]]
    return {"name": name, "metrics": metrics, "loss_end": sum(last) / len(last), "tokens_per_s": tps,
            "wall_s": time.time() - t, "iterations": len(lines)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="benchmarks/prepare_real_text.sh's OUTDIR")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--fp8-args", default="--fp8-format hybrid")
    p.add_argument("--out-dir", default=os.path.join("benchmarks", "fp8_loss"))
    p.add_argument("--png", default=os.path.join("benchmarks", "fp8_loss.png"))
    a = p.parse_args()
    rows = [run(a, "bf16", []), run(a, "fp8", shlex.split(a.fp8_args))]
    for r in rows:
        print(json.dumps(r), flush=True)
    ok = [r for r in rows if "error" not in r]
    if len(ok) == 2:
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_metrics.py"), ok[0]["metrics"],
                        ok[1]["metrics"], "--labels", "bf16", f"fp8 ({a.fp8_args})", "--smooth", "10",
                        "--relative-to-first", "--title", "Llama 1.3B shape, real text: bf16 vs FP8", "-o", a.png],
                       check=False)
    import torch

    print(f"\n{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'} | {a.steps} steps x 16,384 "
          f"tokens | {a.layers} layers")
    print(f"{'run':<6} | {'loss (last 20)':>14} | {'vs bf16':>8} | {'tokens/s':>9} | {'speed vs bf16':>13}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<6} | FAILED: {r['error'][-400:]}")
            continue
        base = rows[0] if "error" not in rows[0] else r
        rel = 100 * (r["loss_end"] / base["loss_end"] - 1)
        speed = (r["tokens_per_s"] / base["tokens_per_s"]) if r["tokens_per_s"] and base["tokens_per_s"] else float("nan")
        print(f"{r['name']:<6} | {r['loss_end']:14.4f} | {rel:+7.2f}% | {r['tokens_per_s'] or 0:9.0f} | {speed:12.3f}x")


if __name__ == "__main__":
    main()
