"""The stall a checkpoint puts on training: no saves, synchronous saves, and --async-save, side by side in one run.

The same engine run (Llama-style, mock data, one process; CPU fp32 or GPU bf16) three times: without --save, with
--save-interval K, and with --save-interval K --async-save. The stall per save is the run's extra wall time over the
no-save run, from the end of the first timed iteration to the end of the last, divided by the saves in that window;
what the save blocks (planning and staging for --async-save, everything for a synchronous save) and what the
background write costs the steps running beside it are both in it. The checkpoint's size is printed.

    python benchmarks/bench_checkpoint.py                      # CPU: about 2 minutes on 2 cores
    python benchmarks/bench_checkpoint.py --hidden 2048 --layers 16 --steps 30   # a GPU
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(a, name: str, extra: list, workdir: str) -> dict:
    import torch

    metrics = os.path.join(workdir, f"{name}.jsonl")
    iters = a.warmup + a.steps
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_megatron_gpt.py"), "--model-family", "llama", "--mock-data",
           "--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.hidden // 64),
           "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq), "--vocab-size", "32000",
           "--micro-batch-size", str(a.micro_batch), "--global-batch-size", str(a.micro_batch), "--train-iters",
           str(iters), "--lr", "1e-4", "--eval-iters", "0", "--log-interval", str(iters), "--hidden-dropout", "0",
           "--attention-dropout", "0", "--metrics-file", metrics,
           *(["--bf16"] if torch.cuda.is_available() else []), *extra]
    t = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    if proc.returncode:
        return {"system": name, "error": proc.stderr[-1500:]}
    lines = [json.loads(x) for x in open(metrics) if '"loss"' in x]
    walls = [x["wall_time"] for x in lines]
    steps = sorted(x["step_time"] for x in lines[a.warmup:])
    return {"system": name, "window_s": walls[-1] - walls[a.warmup], "median_step_s": steps[len(steps) // 2],
            "wall_s": time.time() - t, "params": lines[0]["num_params"], "losses": [x["loss"] for x in lines],
            "saves": len([i for i in range(a.warmup + 1, iters) if i % a.interval == 0]) if extra else 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--interval", type=int, default=5, help="--save-interval")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--out", default=None, help="append the rows as JSON lines here")
    a = p.parse_args()
    import torch

    workdir = a.dir or tempfile.mkdtemp(prefix="bench_checkpoint_")
    rows, size = [], None
    for name, extra in (("no saves", []), ("sync saves", ["--save-interval", str(a.interval)]),
                        ("--async-save", ["--save-interval", str(a.interval), "--async-save"])):
        save = os.path.join(workdir, name.strip("-").replace(" ", "_"))
        shutil.rmtree(save, ignore_errors=True)
        r = run(a, name, extra + (["--save", save] if extra else []), workdir)
        if extra and "error" not in r:
            first = os.path.join(save, sorted(d for d in os.listdir(save) if d.startswith("iter_"))[0])
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(first) for f in fs)
        rows.append(r)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(r) + "\n")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    base = rows[0]
    print(f"\n{device} | Llama {a.layers}L h{a.hidden} seq{a.seq} mb{a.micro_batch} | {base.get('params', 0) / 1e6:.0f}M "
          f"parameters | checkpoint {size / 2**20 if size else float('nan'):.0f} MiB | save every {a.interval} "
          f"iterations, {a.steps} timed")
    print(f"{'system':<14} | {'window s':>8} | {'median step s':>13} | {'saves':>5} | {'stall per save s':>16} | "
          f"{'vs sync':>7}")
    stalls = {}
    for r in rows:
        if "error" in r:
            print(f"{r['system']:<14} | FAILED: {r['error'][-300:]}")
            continue
        stall = (r["window_s"] - base["window_s"]) / r["saves"] if r["saves"] else 0.0
        stalls[r["system"]] = stall
        ratio = f"{stalls['sync saves'] / stall:.1f}x" if r["system"] == "--async-save" and stall > 0 else ""
        print(f"{r['system']:<14} | {r['window_s']:8.2f} | {r['median_step_s']:13.3f} | {r['saves']:>5} | "
              f"{stall:16.3f} | {ratio:>7}")
    same = all(x.get("losses") == base.get("losses") for x in rows if "error" not in x)
    print(f"losses identical across the three runs: {same}")
    if not a.dir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
