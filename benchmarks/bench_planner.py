"""The planner against the engine on one GPU: measure the per-layer speed table, then predict and measure six
single-GPU configurations (peak memory and step time), side by side, in one run.

1. layer speed: for each layer shape, the engine with 1 and with 3 layers (bf16, SDPA, eager, mock data), at the
   shape's micro batch and at twice it; the difference of the median step times of 3 and 1 layers is two layers'
   forward + backward, and the two micro-batch sizes split it into a rate (TFLOP/s at the layer's forward FLOPs per
   token, planning/timing.py layer_flops_per_token) and a fixed cost per micro batch (planning/layer_speed.py
   fit_row). Printed as the table planning/layer_speed.py keeps.
2. validation: six configurations of the engine on one GPU, each predicted by the planner (with the table just
   measured) and measured (median step time after warm-up; torch.cuda.max_memory_allocated).

    python benchmarks/bench_planner.py [--out DIR] [--steps 8] [--warmup 3] [--table-out F | --table-in F]
(--table-out after the table, --table-in instead of measuring it: the two halves in two calls on one card)
Every engine run is one `main()` call of pretrain_megatron_gpt.py in this process (imports paid once).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LLAMA = ["--model-family", "llama", "--vocab-size", "32000", "--mock-data", "--bf16", "--lr", "1e-4",
         "--eval-iters", "0", "--log-interval", "1"]
# (hidden, ffn, heads, query groups, seq, micro batch): Llama-style layers from 1B-class to 70B-class widths
LAYER_SHAPES = [(1024, 2816, 8, 8, 2048, 4), (2048, 5504, 16, 16, 2048, 4), (3072, 8192, 24, 8, 2048, 4),
                (4096, 14336, 32, 8, 2048, 2), (8192, 28672, 64, 8, 2048, 1)]
# six single-GPU configurations the planner predicts (name -> engine flags beyond LLAMA)
VALIDATION = {
    "llama-1.3b mbs4": ["--num-layers", "24", "--hidden-size", "2048", "--ffn-hidden-size", "5504",
                        "--num-attention-heads", "16", "--seq-length", "2048", "--micro-batch-size", "4",
                        "--global-batch-size", "16"],
    "llama-1.3b mbs8 full recompute": ["--num-layers", "24", "--hidden-size", "2048", "--ffn-hidden-size", "5504",
                                       "--num-attention-heads", "16", "--seq-length", "2048", "--micro-batch-size",
                                       "8", "--global-batch-size", "16", "--recompute-granularity", "full"],
    "llama-350m seq4096 zero1": ["--num-layers", "24", "--hidden-size", "1024", "--ffn-hidden-size", "2816",
                                 "--num-attention-heads", "16", "--seq-length", "4096", "--micro-batch-size", "4",
                                 "--global-batch-size", "16", "--zero-1-memory-optimization"],
    "llama3-8b 4 layers": ["--num-layers", "4", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
                           "--num-attention-heads", "32", "--num-query-groups", "8", "--seq-length", "4096",
                           "--micro-batch-size", "2", "--global-batch-size", "8"],
    # not among the runs the activation model's SwiGLU term was fitted on (2026-12-07): a held-out check
    "llama-2.7b-shape 16 layers seq4096 selective": ["--num-layers", "16", "--hidden-size", "2560", "--ffn-hidden-size",
                                                     "6912", "--num-attention-heads", "20", "--seq-length", "4096",
                                                     "--micro-batch-size", "2", "--global-batch-size", "8",
                                                     "--recompute-granularity", "selective"],
    "llama-3b-shape 12 layers mbs2": ["--num-layers", "12", "--hidden-size", "3072", "--ffn-hidden-size", "8192",
                                      "--num-attention-heads", "24", "--num-query-groups", "8", "--seq-length",
                                      "2048", "--micro-batch-size", "2", "--global-batch-size", "8"],
}


def _run(argv, metrics_file):
    """One engine run in this process; its metrics lines."""
    import torch

    from megatron_patch.cli.pretrain import main

    if os.path.exists(metrics_file):
        os.remove(metrics_file)
    env = dict(os.environ)
    from megatron_patch.ports import free_port

    os.environ["MASTER_PORT"] = str(free_port())  # each run its own rendezvous: the last one's port may linger
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    status = main([*argv, "--metrics-file", metrics_file])
    os.environ.clear()  # a fresh launch environment for the next run (initialize() records its port there)
    os.environ.update(env)
    if status:
        raise SystemExit(f"engine run failed ({status}): {' '.join(argv)}")
    import gc

    gc.collect()  # the finished run's model and optimizer, before the next one allocates
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [json.loads(x) for x in open(metrics_file) if '"step_time"' in x]


def _median_step(lines, warmup):
    return statistics.median(x["step_time"] for x in lines[warmup:])


def card_key() -> str:
    import torch

    if not torch.cuda.is_available():
        return "h100-80gb"  # --smoke on a CPU: the H100's table
    name = torch.cuda.get_device_name(0)
    return "h200" if "H200" in name else "h100-80gb" if "H100" in name else name


def measure_layers(out, steps, warmup):
    """The table: each shape's layer at its micro batch and at twice it, so that layer_speed.fit_row separates the
    rate from the fixed cost per micro batch."""
    from megatron_patch.planning.layer_speed import fit_row

    table = []
    for h, ffn, heads, groups, seq, mbs in LAYER_SHAPES:
        pair = (1, 2) if h >= 8192 else (1, 3)  # a 70B-wide layer: 2 of them with Adam state fill most of 80 GB
        per_layer, tokens = [], []
        for micro in (mbs, 2 * mbs):
            flags = [*_shape_flags(h, ffn, heads, groups, seq), "--micro-batch-size", str(micro),
                     "--global-batch-size", str(micro * 2), "--train-iters", str(steps)]
            times = {}
            for layers in pair:
                lines = _run([*flags, "--num-layers", str(layers)],
                             os.path.join(out, f"layers_{h}_mbs{micro}_{layers}.jsonl"))
                times[layers] = _median_step(lines, warmup)
            # two micro batches per step: one layer's forward + backward of one micro batch
            per_layer.append((times[pair[1]] - times[1]) / (pair[1] - 1) / 2)
            tokens.append(micro * seq)
        row = fit_row(_layer_flops(h, ffn, heads, groups, seq), tuple(tokens), tuple(per_layer))
        table.append(row)
        print(f"layer h{h} ffn{ffn} seq{seq}: {1000 * per_layer[0]:.2f} ms per micro batch of {tokens[0]} tokens, "
              f"{1000 * per_layer[1]:.2f} ms of {tokens[1]}: {row[1]:.0f} TFLOP/s + {1000 * row[2]:.2f} ms fixed",
              flush=True)
    table.sort()
    return table


def _shape_flags(h, ffn, heads, groups, seq):
    """The engine flags of a layer shape (LAYER_SHAPES' first five fields)."""
    return [*LLAMA, "--hidden-size", str(h), "--ffn-hidden-size", str(ffn), "--num-attention-heads", str(heads),
            "--num-query-groups", str(groups), "--seq-length", str(seq)]


def _layer_flops(h, ffn, heads, groups, seq):
    """Forward FLOPs per token of one layer of that shape: the table's key."""
    from megatron_patch.config import parse_args
    from megatron_patch.planning.timing import layer_flops_per_token

    return layer_flops_per_token(parse_args([*_shape_flags(h, ffn, heads, groups, seq), "--num-layers", "1"]), moe=False)


def _kept_rows(table, shapes):
    """The rows of `table` (this card's committed one) for the layer shapes not measured now."""
    kept = []
    for h, ffn, heads, groups, seq, _ in shapes:
        f = _layer_flops(h, ffn, heads, groups, seq)
        row = min(table, key=lambda r: abs(r[0] / f - 1))
        assert abs(row[0] / f - 1) < 1e-2, f"no row for h{h} in this card's table"
        kept.append(tuple(row) + (0.0,) * (3 - len(row)))
    return kept


def validate(out, steps, warmup, card):
    from megatron_patch.config import parse_args
    from megatron_patch.config.fit import peak_memory
    from megatron_patch.config.validate import resolve
    from megatron_patch.planning.hardware import GPUS
    from megatron_patch.planning.timing import step_time

    rows = []
    for name, flags in VALIDATION.items():
        argv = [*LLAMA, *flags, "--train-iters", str(steps)]
        lines = _run(argv, os.path.join(out, f"validate_{len(rows)}.jsonl"))
        cfg, vocab = resolve(parse_args(argv), 1), lines[0]["vocab_size"]
        pred_mem = peak_memory(cfg, vocab, 1)
        pred_time = step_time(cfg, vocab, 1, GPUS[card]).total
        meas_time = _median_step(lines, warmup)
        meas_mem = max(x.get("max_memory_bytes", 0) for x in lines)
        rows.append(dict(name=name, predicted_peak=pred_mem.peak, measured_peak=meas_mem, predicted_step=pred_time,
                         measured_step=meas_time, breakdown=pred_mem.as_dict()))
    return rows


def _smoke() -> None:
    global LLAMA, LAYER_SHAPES, VALIDATION
    LLAMA = [x for x in LLAMA if x != "--bf16"]
    LAYER_SHAPES = [(64, 128, 4, 4, 32, 2), (128, 256, 4, 4, 32, 2)]
    VALIDATION = {"tiny": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                           "32", "--micro-batch-size", "2", "--global-batch-size", "4"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_planner"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skip-layers", action="store_true", help="validate with the table in planning/layer_speed.py")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, fp32, for a CPU: the script's own check")
    ap.add_argument("--hidden-sizes", help="measure only the layer shapes of these hidden sizes (comma list); the "
                    "other rows come from planning/layer_speed.py's table for this card")
    ap.add_argument("--table-out", help="write the measured table (JSON) here and stop before validating")
    ap.add_argument("--table-in", help="validate with this table (from --table-out on the same kind of card)")
    a = ap.parse_args()
    if a.smoke:
        _smoke()
    os.makedirs(a.out, exist_ok=True)
    import torch

    from megatron_patch.planning import layer_speed

    card = card_key()
    if a.table_in:
        saved = json.load(open(a.table_in))
        if saved["card"] != card:
            raise SystemExit(f"--table-in {a.table_in} was measured on {saved['card']}, this is {card}")
        layer_speed.MEASURED[card] = [tuple(r) for r in saved["table"]]
    elif not a.skip_layers:
        kept = []
        if a.hidden_sizes:
            global LAYER_SHAPES
            wanted = {int(x) for x in a.hidden_sizes.split(",")}
            skipped = [x for x in LAYER_SHAPES if x[0] not in wanted]
            LAYER_SHAPES = [x for x in LAYER_SHAPES if x[0] in wanted]
            kept = _kept_rows(layer_speed.MEASURED.get(card, []), skipped)
        table = sorted(measure_layers(a.out, a.steps, a.warmup) + kept)
        layer_speed.MEASURED[card] = table
        print(f"MEASURED[{card!r}] = {[(float(f'{f:.4g}'), round(t, 1), float(f'{c:.3g}')) for f, t, c in table]}")
        if a.table_out:
            json.dump({"card": card, "table": table}, open(a.table_out, "w"))
            return
    rows = validate(a.out, a.steps, a.warmup, card)
    with open(os.path.join(a.out, "bench_planner.json"), "w") as f:
        json.dump({"card": card, "table": layer_speed.MEASURED.get(card), "rows": rows}, f,
                  indent=1)
    print(f"\nplanner vs engine, one {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'}")
    print(f"{'configuration':34} {'peak GiB pred':>13} {'meas':>7} {'ratio':>6} | {'step s pred':>11} {'meas':>7} {'ratio':>6}")
    for r in rows:
        print(f"{r['name']:34} {r['predicted_peak'] / 2**30:13.2f} {r['measured_peak'] / 2**30:7.2f} "
              f"{r['predicted_peak'] / max(r['measured_peak'], 1):6.3f} | {r['predicted_step']:11.3f} "
              f"{r['measured_step']:7.3f} {r['predicted_step'] / r['measured_step']:6.3f}")


if __name__ == "__main__":
    main()
