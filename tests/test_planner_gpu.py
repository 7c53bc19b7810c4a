"""The planner against the engine on one GPU (GPU lane): six single-GPU configurations (one held out from the
fit of the activation model), predicted with the measured
per-layer table in planning/layer_speed.py, then run: peak memory within 10% and step time within 15%."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.gpu


def test_planner_predicts_six_single_gpu_runs(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_planner.py"), "--skip-layers", "--out",
                        str(tmp_path), "--steps", "7", "--warmup", "3"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.load(open(tmp_path / "bench_planner.json"))["rows"]
    assert len(rows) == 6
    for r in rows:
        assert r["predicted_peak"] == pytest.approx(r["measured_peak"], rel=0.10), r["name"]
        assert r["predicted_step"] == pytest.approx(r["measured_step"], rel=0.15), r["name"]
