"""Loss curves of several runs in one PNG, read from their --metrics-file JSONL (`tools/plot_metrics.py`).

The records are the ones `training/reporting.py` writes: a training line per iteration (`{"loss": ...,
"iteration": ...}` and more) and a validation line per evaluation (the engine's `{"iteration", "valid_loss"}`,
the torch loop's `{"iteration", "split": "validation", "loss"}`). A run resumed into the same file repeats
iterations: the last line of each iteration is kept (the resumed run's), and the repeats are counted in a note.

    python tools/plot_metrics.py work_dirs/bf16/metrics.jsonl work_dirs/fp8/metrics.jsonl -o curves.png \\
        --smooth 20 --validation --relative-to-first

prints one line per run (its last smoothed value and its relative difference against the first run) and writes
the PNG with matplotlib's Agg canvas (no display needed).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

LAUNCHER_STEM = "metrics"  # pretrain_scripts/launcher.sh writes OUTPUT/metrics.jsonl: the directory names the run


class MetricsError(ValueError):
    """Bad input: one line that names the file or flag and the fix."""


@dataclass
class Run:
    """One metrics file's curves, sorted by x: `y` as read, `smoothed` its trailing moving average."""

    path: str
    label: str
    x: List[float]
    y: List[float]
    smoothed: List[float]
    valid_x: List[float] = field(default_factory=list)
    valid_y: List[float] = field(default_factory=list)


def read_records(path: str) -> List[Dict]:
    """The JSON objects of a JSONL file, one a line (blank lines skipped); MetricsError naming file:line otherwise."""
    if os.path.isdir(path):
        inside = os.path.join(path, LAUNCHER_STEM + ".jsonl")
        hint = f"pass {inside}" if os.path.isfile(inside) else "pass the --metrics-file of a run, not its directory"
        raise MetricsError(f"{path}: a directory: {hint}")
    if not os.path.isfile(path):
        raise MetricsError(f"{path}: no such file: pass the --metrics-file a training run wrote")
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise MetricsError(f"{path}:{n}: not valid JSON ({e.msg}, column {e.colno}): repair or delete that "
                                   f"line (a run killed while writing can leave half a line)") from None
            if not isinstance(record, dict):
                raise MetricsError(f"{path}:{n}: a JSON {type(record).__name__}, not an object: every line of a "
                                   f"--metrics-file is one record {{\"key\": value, ...}}")
            records.append(record)
    if not records:
        raise MetricsError(f"{path}: empty (no JSON lines): pass the --metrics-file of a run that has logged")
    return records


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def numeric_keys(records: Sequence[Dict]) -> List[str]:
    """The keys with a number in some record, in the order they first appear."""
    keys: Dict[str, None] = {}
    for r in records:
        keys.update((k, None) for k, v in r.items() if _number(v))
    return list(keys)


def is_validation(record: Dict) -> bool:
    """The torch loop marks evaluation lines with "split"; the engine's training lines have none."""
    return record.get("split", "train") != "train"


def _points(pairs: List[Tuple[float, float]]) -> Tuple[List[float], List[float], int]:
    """Sorted by x, the last pair of each x kept; also how many earlier pairs were replaced."""
    last = dict(pairs)
    xs = sorted(last)
    return xs, [last[x] for x in xs], len(pairs) - len(last)


def training_series(records: Sequence[Dict], path: str, key: str, x: str) -> Tuple[List[float], List[float]]:
    """(x, y) of the training lines that hold `key` and `x`; notes on stderr for what is left out or repeated."""
    holding = [r for r in records if not is_validation(r) and _number(r.get(key))]
    if not holding:
        raise MetricsError(f"{path}: no training line holds {key!r} (its keys: {', '.join(numeric_keys(records))}): "
                           f"pass a --metrics-file of a training run, or a --key it has")
    with_x = [r for r in holding if _number(r.get(x))]
    if not with_x:
        raise MetricsError(f"{path}: the lines with {key!r} hold no {x!r} (--x): choose --x among "
                           f"{', '.join(k for k in numeric_keys(holding) if k != key)}")
    finite = [(float(r[x]), float(r[key])) for r in with_x if math.isfinite(r[key]) and math.isfinite(r[x])]
    left_out = len(holding) - len(finite)
    if left_out:
        print(f"note: {path}: {left_out} line(s) with {key!r} left out (no {x!r}, or not finite)", file=sys.stderr)
    if not finite:
        raise MetricsError(f"{path}: no finite {key!r} in any line: the run diverged from its first logged step")
    xs, ys, repeated = _points(finite)
    if repeated:
        print(f"note: {path}: {repeated} repeated {x}(s) (a resumed run?): the last line of each is plotted",
              file=sys.stderr)
    return xs, ys


def validation_series(records: Sequence[Dict], key: str, x: str) -> Tuple[List[float], List[float]]:
    """(x, y) of the validation lines: the engine's `valid_<key>`, or `key` on a line whose split is validation."""
    pairs = []
    for r in records:
        value = r.get(f"valid_{key}") if not is_validation(r) else (r.get(key) if r["split"] == "validation" else None)
        if _number(value) and _number(r.get(x)) and math.isfinite(value):
            pairs.append((float(r[x]), float(value)))
    xs, ys, _ = _points(pairs)  # the engine logs the last iteration's validation twice when it is also an interval
    return xs, ys


def moving_average(values: Sequence[float], window: int) -> List[float]:
    """Trailing mean over the last `window` values (fewer at the start); `window` 1 returns the values."""
    if window < 1:
        raise ValueError(f"moving-average window {window}: at least 1")
    v = np.asarray(values, dtype=np.float64)
    csum = np.concatenate([[0.0], np.cumsum(v)])
    ends = np.arange(1, len(v) + 1)
    starts = np.maximum(ends - window, 0)
    return ((csum[ends] - csum[starts]) / (ends - starts)).tolist()


def relative_difference(base_x: Sequence[float], base_y: Sequence[float], x: Sequence[float],
                        y: Sequence[float]) -> Tuple[List[float], List[float]]:
    """100 * (y - base) / |base| in percent at the x values both curves have (a zero base value is skipped)."""
    base = dict(zip(base_x, base_y))
    pairs = [(xi, 100.0 * (yi - base[xi]) / abs(base[xi])) for xi, yi in zip(x, y) if base.get(xi)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def default_labels(paths: Sequence[str]) -> List[str]:
    """The file's stem (`bf16.jsonl` -> bf16), or its directory's name where the stems say nothing: they repeat, or
    they are the launcher's `metrics` (work_dirs/bf16/metrics.jsonl -> bf16); the paths as given if those repeat."""
    stems = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    if len(set(stems)) == len(stems) and LAUNCHER_STEM not in stems:
        return stems
    dirs = [os.path.basename(os.path.dirname(os.path.abspath(p))) or s for p, s in zip(paths, stems)]
    labels = [d if s == LAUNCHER_STEM or stems.count(s) > 1 else s for d, s in zip(dirs, stems)]
    return labels if len(set(labels)) == len(labels) else list(paths)


def load_runs(paths: Sequence[str], labels: Optional[Sequence[str]] = None, key: str = "loss",
              x: str = "iteration", smooth: int = 1, validation: bool = False) -> List[Run]:
    """Read and check every file; MetricsError on the first problem, naming the file or the flag."""
    if not paths:
        raise MetricsError("no metrics files: pass one or more --metrics-file JSONL paths")
    if labels is not None and len(labels) != len(paths):
        raise MetricsError(f"--labels: {len(labels)} label(s) for {len(paths)} file(s): give one label per file, "
                           f"in the files' order, or leave --labels out")
    if smooth < 1:
        raise MetricsError(f"--smooth {smooth}: the moving-average window is at least 1 (1: no smoothing)")
    records = [read_records(p) for p in paths]
    every = numeric_keys([r for rs in records for r in rs])
    if key not in every and not (validation and f"valid_{key}" in every):
        raise MetricsError(f"--key {key}: no file has it; pass one of the keys they have: {', '.join(every)}")
    labels = list(labels) if labels is not None else default_labels(paths)
    runs = []
    for path, label, rs in zip(paths, labels, records):
        xs, ys = training_series(rs, path, key, x)
        run = Run(path, label, xs, ys, moving_average(ys, smooth))
        if validation:
            run.valid_x, run.valid_y = validation_series(rs, key, x)
        runs.append(run)
    return runs


def _percent(value: float) -> str:
    return f"{value:+.3f}%"


def summary(runs: Sequence[Run], key: str = "loss", x: str = "iteration", smooth: int = 1,
            validation: bool = False) -> str:
    """A table, one row per run: its last x, last smoothed value, and the difference against the first run in
    percent, taken at the last x both runs have (named when it is not the run's last); with `validation` the last
    validation value too."""
    value_head = f"{key} (smoothed over {smooth})" if smooth > 1 else key
    head = ["run", x, value_head, f"vs {runs[0].label}"] + ([f"valid {key}"] if validation else [])
    rows = [head]
    first = runs[0]
    for i, run in enumerate(runs):
        if i == 0:
            vs = "-"
        else:
            common_x, rel = relative_difference(first.x, first.smoothed, run.x, run.smoothed)
            vs = "n/a (no common " + x + ")" if not rel else _percent(rel[-1])
            if rel and common_x[-1] != run.x[-1]:
                vs += f" at {x} {common_x[-1]:g}"
        row = [run.label, f"{run.x[-1]:g}", f"{run.smoothed[-1]:.6g}", vs]
        if validation:
            row.append(f"{run.valid_y[-1]:.6g}" if run.valid_y else "-")
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in
                               enumerate(zip(r, widths))).rstrip() for r in rows)


def plot(runs: Sequence[Run], output: str, key: str = "loss", x: str = "iteration", title: Optional[str] = None,
         log_y: bool = False, relative_to_first: bool = False, smooth: int = 1) -> None:
    """Write the PNG: the smoothed curves (the raw ones faint behind them when smoothed), validation points, and
    with `relative_to_first` a second panel of each run's difference against the first in percent."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise MetricsError("matplotlib is not installed: pip install matplotlib (setup.py lists it)") from None
    if not output.lower().endswith(".png"):
        raise MetricsError(f"-o {output}: the plot is a PNG: name the output *.png")
    fig = Figure(figsize=(10, 8 if relative_to_first else 6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    if relative_to_first:
        ax, rel_ax = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    else:
        ax, rel_ax = fig.subplots(), None
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for run, color in zip(runs, colors):
        if smooth > 1:
            ax.plot(run.x, run.y, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(run.x, run.smoothed, color=color, linewidth=1.5, label=run.label)
        if run.valid_x:
            ax.plot(run.valid_x, run.valid_y, color=color, linestyle="--", marker="o", markersize=4,
                    label=f"{run.label} (validation)")
    ax.set_ylabel(f"{key} (moving average of {smooth})" if smooth > 1 else key)
    if log_y:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title if title is not None else f"{key} by {x}")
    if rel_ax is not None:
        rel_ax.axhline(0.0, color=colors[0], linewidth=1.0, label=runs[0].label)
        for run, color in zip(runs[1:], colors[1:]):
            rel_ax.plot(*relative_difference(runs[0].x, runs[0].smoothed, run.x, run.smoothed), color=color,
                        linewidth=1.2, label=run.label)
        rel_ax.set_ylabel(f"vs {runs[0].label} (%)")
        rel_ax.grid(True, alpha=0.3)
        rel_ax.legend()
    (rel_ax or ax).set_xlabel(x)
    if all(float(v).is_integer() for run in runs for v in run.x):  # iterations: no ticks at 2.5
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    parent = os.path.dirname(os.path.abspath(output))
    try:
        os.makedirs(parent, exist_ok=True)
        fig.savefig(output, format="png")
    except OSError as e:
        raise MetricsError(f"-o {output}: cannot write it ({e.strerror}): choose a writable path") from None


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="plot_metrics.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="METRICS.jsonl", help="--metrics-file outputs, one per run; the "
                   "first is the reference of the comparison")
    p.add_argument("-o", "--output", default="loss_curves.png", help="the PNG to write (default loss_curves.png)")
    p.add_argument("--labels", nargs="+", default=None, help="one legend label per file (default: the file's stem, "
                   "or its directory's name for the launcher's metrics.jsonl)")
    p.add_argument("--key", default="loss", help="the value to plot (default loss; e.g. grad_norm, lr, lm_loss)")
    p.add_argument("--x", default="iteration", help="the x axis: a key of the records (default iteration; tokens "
                   "or samples where the records hold them)")
    p.add_argument("--smooth", type=int, default=1, metavar="N", help="trailing moving average over N points "
                   "(default 1: none); the table's values are smoothed too")
    p.add_argument("--title", default=None, help="the plot's title (default: KEY by X)")
    p.add_argument("--validation", action="store_true", help="also plot the validation values where the files "
                   "have them (valid_KEY lines)")
    p.add_argument("--log-y", action="store_true", help="a logarithmic y axis")
    p.add_argument("--relative-to-first", action="store_true", help="a second panel: each run's difference against "
                   "the first run in percent (e.g. fp8 against bf16)")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    """The CLI: exit status 0, or 2 with one `plot_metrics error: ...` line on stderr."""
    a = get_args(argv)
    try:
        runs = load_runs(a.files, a.labels, a.key, a.x, a.smooth, a.validation)
        plot(runs, a.output, a.key, a.x, a.title, a.log_y, a.relative_to_first, a.smooth)
    except MetricsError as e:
        print(f"plot_metrics error: {e}", file=sys.stderr)
        return 2
    print(summary(runs, a.key, a.x, a.smooth, a.validation))
    print(f"wrote {a.output}")
    return 0
