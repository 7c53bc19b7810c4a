"""Several GPUs of one host: correctness against one GPU, weak scaling, TP/PP overhead, ZeRO memory,
in one call, one table (issue: 3D parallelism and ZeRO with NCCL on 2-8 GPUs).

Every row runs pretrain_megatron_gpt.py under torchrun with --metrics-file and is read back:
  correctness  20 iterations of the same model and global batch in each layout (TP2, PP2, PP2+VPP,
               DP2+ZeRO-1, DP2+ZeRO-2, TP2xPP2xDP2) against 1 GPU: max relative loss difference
               (bf16: expect < 2e-2, the rounding of different reduction orders)
  scaling      DP on 1, 2, 4, 8 GPUs with the same micro batch per GPU: tokens/s and weak-scaling efficiency
  overhead     TP2 and PP2 against DP2 on the same 2 GPUs
  memory       per-rank optimizer-state and gradient bytes without ZeRO, with ZeRO-1 and ZeRO-2,
               against 12N/d and 4N/d (bf16 Adam)

    python benchmarks/bench_multigpu.py [--gpus 8] [--model-size 1.3b] [--cpu-smoke]
--cpu-smoke runs every row with a tiny model on CPU processes (gloo), to check the script itself.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(nproc: int, args, base) -> list:
    metrics = tempfile.mktemp(suffix=".jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), os.path.join(ROOT, "pretrain_megatron_gpt.py"), *base, *args, "--metrics-file", metrics]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return [json.loads(x) for x in open(metrics)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--model-size", default="1.3b")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--cpu-smoke", action="store_true")
    a = p.parse_args()
    if a.cpu_smoke:
        base = ("--mock-data --vocab-size 128 --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                "--micro-batch-size 2 --hidden-dropout 0 --attention-dropout 0 --init-layout-invariant").split()
        tol = 1e-5
    else:
        base = (f"--model-family llama --model-size {a.model_size} --mock-data --vocab-size 32000 --seq-length 2048 "
                "--micro-batch-size 2 --bf16 --init-layout-invariant").split()
        tol = 2e-2
    base += ["--train-iters", str(a.iters), "--log-interval", str(a.iters), "--eval-iters", "0", "--lr", "1e-4"]
    g = a.gpus
    rows = []

    gbs = ["--global-batch-size", "16"]
    ref = [x["loss"] for x in run(1, gbs, base) if "loss" in x]
    layouts = [("TP2", 2, ["--tensor-model-parallel-size", "2"]), ("PP2", 2, ["--pipeline-model-parallel-size", "2"]),
               ("PP2 VPP2", 2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                                "1" if a.cpu_smoke else "6"]),
               ("DP2 ZeRO-1", 2, ["--zero-1-memory-optimization"]), ("DP2 ZeRO-2", 2, ["--zero-2-memory-optimization"]),
               ("TP2xPP2xDP2 ZeRO-1", 8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                          "--zero-1-memory-optimization"])]
    for name, n, extra in layouts:
        if n > g:
            continue
        losses = [x["loss"] for x in run(n, gbs + extra, base) if "loss" in x]
        diff = max(abs(x - y) / abs(y) for x, y in zip(losses, ref))
        rows.append(("correctness", name, f"{n} GPU", f"max rel loss diff {diff:.2e}", "ok" if diff < tol else "FAIL"))

    def tps(lines, n_tokens):
        times = [x["step_time"] for x in lines if "step_time" in x][3:]
        return n_tokens / (sum(times) / len(times))

    seq = 32 if a.cpu_smoke else 2048
    one = None
    for n in (1, 2, 4, 8):
        if n > g:
            continue
        t = tps(run(n, ["--global-batch-size", str(2 * n)], base), 2 * n * seq)
        one = one or t
        rows.append(("scaling", f"DP{n}", f"{n} GPU", f"{t:,.0f} tokens/s", f"efficiency {t / (one * n):.0%}"))
    if g >= 2:
        dp2 = tps(run(2, ["--global-batch-size", "4"], base), 4 * seq)
        for name, extra in (("TP2", ["--tensor-model-parallel-size", "2"]), ("PP2", ["--pipeline-model-parallel-size", "2"])):
            t = tps(run(2, ["--global-batch-size", "4"] + extra, base), 4 * seq)
            rows.append(("overhead", name, "2 GPU", f"{t:,.0f} tokens/s", f"{t / dp2:.2f}x of DP2"))
        for z in (0, 1, 2):
            extra = [f"--zero-{z}-memory-optimization"] if z else []
            lines = run(2, ["--global-batch-size", "4", "--bf16"] + extra, base)
            m = next(x for x in lines if "bytes_optimizer" in x)
            n_p, d = m["num_params"], 2 if z else 1
            rows.append(("memory", f"ZeRO-{z}", "2 GPU", f"opt {m['bytes_optimizer'] / 2**30:.2f} GiB "
                         f"(12N/d {12 * n_p / d / 2**30:.2f}), grads {m['bytes_grads'] / 2**30:.2f} GiB "
                         f"(4N/{2 if z == 2 else 1} {4 * n_p / (2 if z == 2 else 1) / 2**30:.2f})", ""))
    print(f"\n{'what':<12} | {'layout':<20} | {'GPUs':<6} | {'measured':<60} | note")
    for r in rows:
        print(f"{r[0]:<12} | {r[1]:<20} | {r[2]:<6} | {r[3]:<60} | {r[4]}")


if __name__ == "__main__":
    main()
