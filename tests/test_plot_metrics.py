"""tools/plot_metrics.py (megatron_patch/training/plot_metrics.py): the PNG, the printed table and each bad input's
one-line error, on small metrics files written line for line as the engine's reporter writes them."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import List, Optional, Sequence

import pytest

from megatron_patch.training.plot_metrics import main, moving_average

REPO = pathlib.Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(path: pathlib.Path, losses: Sequence[float], valid: Optional[dict] = None, start: int = 1) -> str:
    """A --metrics-file as training/reporting.py writes it: a training line per iteration (the first with the
    model-state sizes), and {"iteration", "valid_loss"} after the iterations in `valid`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for i, loss in enumerate(losses, start):
            record = {"loss": loss, "grad_norm": 1.5, "skipped": 0.0, "lr": 1e-4, "loss_scale": 1.0, "iteration": i,
                      "step_time": 0.03, "wall_time": 1796639766.0 + i}
            if i == start:
                record.update(bytes_weights=441344, bytes_grads=441344, bytes_optimizer=882688, num_params=110336)
            f.write(json.dumps(record) + "\n")
            if valid and i in valid:
                f.write(json.dumps({"iteration": i, "valid_loss": valid[i]}) + "\n")
    return str(path)


def table_rows(out: str) -> List[List[str]]:
    """The printed table's rows split into cells (the header first), without the `wrote` line."""
    return [line.split() for line in out.splitlines() if line and not line.startswith("wrote ")]


def test_png_is_written_and_readable(tmp_path):
    import matplotlib.image

    a = write_run(tmp_path / "bf16.jsonl", [5.0 - 0.1 * i for i in range(30)], valid={10: 4.2, 20: 3.4})
    b = write_run(tmp_path / "fp8.jsonl", [5.0 - 0.09 * i for i in range(30)], valid={10: 4.3, 20: 3.5})
    for relative, height in ((False, 600), (True, 800)):
        out = tmp_path / f"sub/curves_{relative}.png"  # a directory that does not exist yet
        args = [a, b, "-o", str(out), "--smooth", "4", "--validation", "--log-y", "--title", "t"]
        assert main(args + (["--relative-to-first"] if relative else [])) == 0
        assert out.read_bytes()[:8] == PNG_MAGIC
        image = matplotlib.image.imread(out)
        assert image.shape[:2] == (height, 1000)
        assert image.std() > 0.05  # curves, not a blank canvas


def test_default_output_in_cwd(tmp_path, monkeypatch):
    a = write_run(tmp_path / "run.jsonl", [3.0, 2.0, 1.0])
    monkeypatch.chdir(tmp_path)
    assert main([a]) == 0
    assert (tmp_path / "loss_curves.png").read_bytes()[:8] == PNG_MAGIC


def test_table_values_smoothed_and_relative(tmp_path, capsys):
    a = write_run(tmp_path / "a.jsonl", [5.0, 4.0, 3.0, 2.0], valid={4: 2.25})
    b = write_run(tmp_path / "b.jsonl", [5.0, 4.5, 3.5, 2.5])
    assert main([a, b, "-o", str(tmp_path / "c.png"), "--smooth", "3", "--validation", "--labels", "bf16", "fp8"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert rows[0][:2] == ["run", "iteration"]
    # last value: the mean of the last 3 losses; against the first run: 100 * (3.5 - 3.0) / 3.0
    assert rows[1] == ["bf16", "4", "3", "-", "2.25"]
    assert rows[2] == ["fp8", "4", "3.5", "+16.667%", "-"]


def test_table_without_smoothing_and_shorter_run(tmp_path, capsys):
    a = write_run(tmp_path / "a.jsonl", [4.0, 3.0, 2.0, 1.0])
    b = write_run(tmp_path / "b.jsonl", [4.0, 2.7])  # stopped at iteration 2: compared there
    assert main([a, b, "-o", str(tmp_path / "c.png")]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert rows[1] == ["a", "4", "1", "-"]
    assert rows[2] == ["b", "2", "2.7", "-10.000%"]  # 100 * (2.7 - 3.0) / 3.0


def test_default_labels_are_the_run_directories(tmp_path, capsys):
    a = write_run(tmp_path / "work_dirs/gpt_bf16/metrics.jsonl", [2.0, 1.0])
    b = write_run(tmp_path / "work_dirs/gpt_fp8/metrics.jsonl", [2.0, 1.1])
    assert main([a, b, "-o", str(tmp_path / "c.png"), "--relative-to-first"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert [r[0] for r in rows[1:]] == ["gpt_bf16", "gpt_fp8"]
    assert rows[0][-2:] == ["vs", "gpt_bf16"]
    assert rows[2][-1] == "+10.000%"


def test_resumed_run_keeps_the_last_line_of_each_iteration(tmp_path, capsys):
    path = tmp_path / "resumed.jsonl"
    write_run(path, [4.0, 3.0, 2.0, 9.0])  # iterations 1..4; the run stopped and resumed from iteration 2
    write_run(path, [2.5, 1.5, 0.5], start=3)  # iterations 3..5 again
    assert main([str(path), "-o", str(tmp_path / "c.png"), "--smooth", "2"]) == 0
    captured = capsys.readouterr()
    assert table_rows(captured.out)[1] == ["resumed", "5", "1", "-"]  # (1.5 + 0.5) / 2: not the first run's 9.0
    assert "2 repeated iteration(s)" in captured.err


def test_other_key_and_x_and_torch_loop_validation(tmp_path, capsys):
    # the torch loop's pretraining file: validation lines carry "split" and the same "loss" key
    path = tmp_path / "pretrainer.jsonl"
    lines = [{"iteration": 1, "loss": 3.0, "lr": 1e-4, "grad_norm": 2.0, "skipped": False, "samples_per_s": 8.0,
              "samples": 8},
             {"iteration": 2, "loss": 2.0, "lr": 1e-4, "grad_norm": 1.0, "skipped": False, "samples_per_s": 8.0,
              "samples": 16},
             {"iteration": 2, "split": "validation", "loss": 2.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main([str(path), "-o", str(tmp_path / "c.png"), "--validation"]) == 0
    assert table_rows(capsys.readouterr().out)[1] == ["pretrainer", "2", "2", "-", "2.5"]
    assert main([str(path), "-o", str(tmp_path / "c.png"), "--key", "grad_norm", "--x", "samples"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert rows[0][:3] == ["run", "samples", "grad_norm"] and rows[1][1:3] == ["16", "1"]


def test_moving_average_is_trailing():
    values = [1.0, 2.0, 6.0, 3.0, 8.0]
    expected = [sum(values[max(0, i - 2):i + 1]) / len(values[max(0, i - 2):i + 1]) for i in range(len(values))]
    assert moving_average(values, 3) == pytest.approx(expected)
    assert moving_average(values, 1) == values
    assert moving_average(values, 100) == pytest.approx([1.0, 1.5, 3.0, 3.0, 4.0])


def _bad_inputs(tmp_path: pathlib.Path):
    good = write_run(tmp_path / "good.jsonl", [3.0, 2.0])
    valid_only = tmp_path / "valid_only.jsonl"
    valid_only.write_text(json.dumps({"iteration": 10, "valid_loss": 2.0}) + "\n")
    broken = write_run(tmp_path / "broken.jsonl", [3.0, 2.0])
    with open(broken, "a") as f:
        f.write('{"loss": 1.0, "iterat\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    missing = str(tmp_path / "nope.jsonl")
    return {
        "missing file": ([good, missing], [f"{missing}: no such file", "--metrics-file"]),
        "no line holds the key": ([good, str(valid_only)],
                                  [f"{valid_only}: no training line holds 'loss'", "iteration, valid_loss", "--key"]),
        "unknown key": ([good, "--key", "los"], ["--key los: no file has it", "loss, grad_norm, skipped, lr"]),
        "broken JSON line": ([good, broken], [f"{broken}:3: not valid JSON", "repair or delete that line"]),
        "labels count": ([good, good, "--labels", "bf16"], ["--labels: 1 label(s) for 2 file(s)", "one label per file"]),
        "empty file": ([str(empty)], [f"{empty}: empty"]),
        "unknown x": ([good, "--x", "tokens"], ["hold no 'tokens' (--x)", "choose --x among", "iteration"]),
        "smooth window": ([good, "--smooth", "0"], ["--smooth 0", "at least 1"]),
        "output not png": ([good, "-o", str(tmp_path / "c.pdf")], ["c.pdf: the plot is a PNG", "*.png"]),
        "a directory": ([str(tmp_path)], [f"{tmp_path}: a directory"]),
    }


BAD = ["missing file", "no line holds the key", "unknown key", "broken JSON line", "labels count", "empty file",
       "unknown x", "smooth window", "output not png", "a directory"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case):
    argv, phrases = _bad_inputs(tmp_path)[case]
    out = tmp_path / "curves.png"
    if "-o" not in argv:
        argv = argv + ["-o", str(out)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("plot_metrics error: "), captured.err
    for phrase in phrases:
        assert phrase in lines[0]
    assert captured.out == ""
    assert not out.exists()


def test_cli_script_error_has_no_traceback(tmp_path):
    """The tool itself, as a user runs it: exit status 2 and one line, also from another working directory."""
    good = write_run(tmp_path / "good.jsonl", [3.0, 2.0])
    env = dict(os.environ, PYTHONPATH=str(REPO))
    tool = str(REPO / "tools" / "plot_metrics.py")
    r = subprocess.run([sys.executable, tool, good, str(tmp_path / "missing.jsonl")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"plot_metrics error: {tmp_path / 'missing.jsonl'}: no such file: pass "
                                             f"the --metrics-file a training run wrote"]
    r = subprocess.run([sys.executable, tool, good, "--labels", "x"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "loss_curves.png").read_bytes()[:8] == PNG_MAGIC
    assert r.stdout.splitlines()[-1] == "wrote loss_curves.png"
