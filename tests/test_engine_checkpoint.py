"""Checkpoints: a resumed run continues exactly as the uninterrupted one (dropout on, any stop), a
half-written or corrupt checkpoint is never loaded, weights move to other layouts, and loading a
checkpoint cannot run code."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from engine_utils import ROOT, TINY, free_port, full_weights, rewind_validation, run_engine, train_losses

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # Megatron's default: resume must restore RNG
TEN = ["--train-iters", "10", "--eval-interval", "5", *DROPOUT]


def valid_losses(lines):
    return [x["valid_loss"] for x in lines if "valid_loss" in x]


def resume_from(src, iteration, dst):
    """A copy of checkpoint directory `src` as it stood after saving `iteration`."""
    shutil.copytree(src, dst)
    for path in dst.iterdir():  # iter_N/ and full_weights()'s iter_N.pt beside it
        if path.name.startswith("iter_") and int(path.name[5:12]) > iteration:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    (dst / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return dst


def assert_same_continuation(straight, resumed, start, rel=1e-6):
    """Iterations after `start`: losses, grad norms and learning rates, and the last validation loss."""
    key = lambda lines, k: [x[k] for x in lines if k in x and x["iteration"] > start]  # noqa: E731
    assert key(resumed, "loss") == pytest.approx(key(straight, "loss"), rel=rel)
    assert len(key(resumed, "loss")) == len(key(straight, "loss")) > 0
    assert key(resumed, "grad_norm") == pytest.approx(key(straight, "grad_norm"), rel=rel)
    assert key(resumed, "lr") == pytest.approx(key(straight, "lr"), rel=1e-12)
    assert valid_losses(resumed)[-1] == pytest.approx(valid_losses(straight)[-1], rel=rel)


def assert_same_weights(a_dir, b_dir, atol=1e-6):
    a, b = full_weights(str(a_dir)), full_weights(str(b_dir))
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, 10 iterations, dropout 0.1, a checkpoint every 2 iterations of which the newest 3 are kept."""
    d = tmp_path_factory.mktemp("single")
    (d / "ck" / "iter_0000001.tmp").mkdir(parents=True)  # left by an interrupted save: cleaned up
    lines, proc = run_engine(d, 1, *TEN, "--save", str(d / "ck"), "--save-interval", "2", "--keep-last-n", "3")
    return d, lines, proc


def test_keep_last_n_prunes_old_checkpoints(single):
    d, _, _ = single
    assert sorted(os.listdir(d / "ck")) == ["iter_0000006", "iter_0000008", "iter_0000010",
                                            "latest_checkpointed_iteration.txt"]
    manifest = json.loads((d / "ck" / "iter_0000010" / "checkpoint.json").read_text())
    assert manifest["iteration"] == 10 and manifest["consumed_samples"] == 80
    assert manifest["config"]["hidden_size"] == 64 and manifest["config"]["num_layers"] == 4  # model args kept
    assert manifest["model"]["padded_vocab_size"] == 128 and manifest["layout"]["tp"] == 1


def test_resume_with_dropout_is_exact(single, tmp_path):
    d, straight, _ = single
    ck = resume_from(d / "ck", 6, tmp_path / "ck")
    resumed, proc = run_engine(tmp_path, 1, *TEN, "--load", str(ck), "--save", str(ck))
    assert "loaded checkpoint" in proc.stdout and "(iteration 6)" in proc.stdout
    assert_same_continuation(straight, resumed, 6)
    assert_same_weights(d / "ck" / "iter_0000010", ck / "iter_0000010")


@pytest.mark.parametrize("extra", [
    # slow: test_dp_size_change_keeps_model_optimizer_and_data_position (DP2 ZeRO-1 saved, resumed at DP1) stays fast
    pytest.param(["--zero-1-memory-optimization"], id="dp2_zero1", marks=pytest.mark.slow),
    # slow for CI time (make test-all runs it; the GPU lane resumes bf16 ZeRO-2)
    pytest.param(["--zero-2-memory-optimization"], id="dp2_zero2", marks=pytest.mark.slow),
    # slow: tests/test_gpu.py resumes bf16 ZeRO-2 on the GPU in the gpu lane
    pytest.param(["--zero-2-memory-optimization", "--bf16"], id="dp2_zero2_bf16", marks=pytest.mark.slow)])
def test_resume_with_dropout_is_exact_under_zero(tmp_path, extra):
    """--exit-interval 5, then --load: the second half equals the uninterrupted run."""
    straight, _ = run_engine(tmp_path / "straight", 2, *TEN, *extra, "--save", str(tmp_path / "s"))
    first, _ = run_engine(tmp_path / "first", 2, *TEN, *extra, "--exit-interval", "5", "--save", str(tmp_path / "ck"))
    assert len(train_losses(first)) == 5 and (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text() == "5"
    second, _ = run_engine(tmp_path / "second", 2, *TEN, *extra, "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "ck"))
    rel = 1e-6 if "--bf16" not in extra else 1e-2  # bf16 kernels are not bitwise reproducible across processes
    assert_same_continuation(straight, first + second, 0, rel=rel)
    if "--bf16" not in extra:
        assert_same_weights(tmp_path / "s" / "iter_0000010", tmp_path / "ck" / "iter_0000010")


def test_zero2_resume_is_exact(tmp_path):
    """The default lane's guard of ZeRO-2 checkpoints (Megatron-FSDP DTensors through torch DCP, a path of their
    own): DP2, the straight run's iteration-5 checkpoint resumed, dropout on. Two launches of 2 processes,
    about 20 s of CPU (the dp2_zero2 case above adds the --exit-interval stop in the slow lane)."""
    zero2 = ["--zero-2-memory-optimization"]
    straight, _ = run_engine(tmp_path / "straight", 2, *TEN, *zero2, "--save", str(tmp_path / "s"),
                             "--save-interval", "5", torchrun=False)
    ck = resume_from(tmp_path / "s", 5, tmp_path / "ck")
    resumed, proc = run_engine(tmp_path / "resumed", 2, *TEN, *zero2, "--load", str(ck), "--save", str(ck),
                               torchrun=False)
    assert "loaded checkpoint" in proc.stdout and "(iteration 5)" in proc.stdout
    assert_same_continuation(straight, resumed, 5)
    assert_same_weights(tmp_path / "s" / "iter_0000010", ck / "iter_0000010")


def test_zero2_checkpoint_resumes_at_another_dp_and_tp_size(tmp_path):
    """ZeRO-2 saved at TP1 x DP2, resumed at DP1, at TP2 x DP1 and at PP2 x DP1 (same global batch; dropout 0, so the layout does
    not change which masks a sample sees), a Llama-shaped model (SwiGLU, whose fc1 is stored as its TP-global gate
    and up halves; grouped-query attention): torch DCP reshards Megatron-FSDP's DTensors, and each run continues as
    the one that never stopped, optimizer state and lr schedule included (fp32, within 1e-5). A checkpoint written
    before that (no fully-reshardable mark) is refused at another TP in words."""
    ten = ["--train-iters", "8", "--eval-interval", "4", "--zero-2-memory-optimization", "--lr", "1e-3", "--swiglu",
           "--num-query-groups", "2"]
    straight, _ = run_engine(tmp_path / "dp2", 2, *ten, "--save", str(tmp_path / "s"), "--save-interval", "4",
                             torchrun=False)
    ck = resume_from(tmp_path / "s", 4, tmp_path / "ck")
    assert json.load(open(ck / "iter_0000004" / "checkpoint.json"))["optimizer_sharding"] == "fully_reshardable"
    resumed, proc = run_engine(tmp_path / "dp1", 1, *ten, "--load", str(ck))
    assert "'dp': 2" in proc.stdout and "'dp': 1" in proc.stdout and "start fresh" not in proc.stdout, proc.stdout[-2000:]
    assert_same_continuation(straight, resumed, 4, rel=1e-5)
    resumed, proc = run_engine(tmp_path / "tp2", 2, *ten, "--tensor-model-parallel-size", "2", "--load", str(ck),
                               torchrun=False)
    assert "'tp': 1" in proc.stdout and "weights resharded" in proc.stdout, proc.stdout[-2000:]
    assert "optimizer and lr schedule start fresh" not in proc.stdout, proc.stdout[-2000:]
    assert_same_continuation(straight, resumed, 4, rel=1e-5)
    # PP2: the last stage's copy of the tied embedding, absent from a one-stage checkpoint, loads from the embedding
    resumed, proc = run_engine(tmp_path / "pp2", 2, *ten, "--pipeline-model-parallel-size", "2", "--load", str(ck),
                               torchrun=False)
    assert "'pp': 2" in proc.stdout and "optimizer and lr schedule start fresh" not in proc.stdout, proc.stdout[-2000:]
    assert_same_continuation(straight, resumed, 4, rel=1e-5)
    manifest = ck / "iter_0000004" / "checkpoint.json"
    old = json.load(open(manifest))
    del old["optimizer_sharding"]
    manifest.write_text(json.dumps(old))
    _, proc = run_engine(tmp_path / "tp2_old", 2, *ten, "--tensor-model-parallel-size", "2", "--load", str(ck),
                         check=False, torchrun=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "written before ZeRO-2 checkpoints became fully reshardable" in out, out[-2000:]
    assert "Resume with TP 1, PP 1 and ZeRO-2" in out


SLOW_MODEL = ["--hidden-size", "256", "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "8"]


# all slow for CI time: test_incomplete_newest_checkpoint_falls_back_to_previous keeps the property in the default lane
@pytest.mark.parametrize("nproc,extra", [pytest.param(1, [], marks=pytest.mark.slow),
                                         pytest.param(2, ["--zero-1-memory-optimization"], marks=pytest.mark.slow),
                                         pytest.param(2, ["--zero-2-memory-optimization"], marks=pytest.mark.slow)],
                         ids=["single", "dp2_zero1", "dp2_zero2"])
def test_resume_after_kill_9(tmp_path, nproc, extra):
    """Every process killed with SIGKILL right after the iteration-4 checkpoint is published."""
    args = [*TINY, *TEN, *SLOW_MODEL, "--save-interval", "4", *extra]
    straight, _ = run_engine(tmp_path / "straight", nproc, *args[len(TINY):], "--save", str(tmp_path / "s"))
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
           os.path.join(ROOT, "pretrain_megatron_gpt.py"), *args, "--save", str(ck)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    tracker = ck / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 600
    while not (tracker.exists() and tracker.read_text() == "4"):
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.01)
    everyone = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for pid in everyone:  # torchrun starts its workers in sessions of their own: kill each process
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    time.sleep(1)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in everyone)
    assert not (ck / "iter_0000008").exists(), "killed too late: the second checkpoint was already written"
    resumed, out = run_engine(tmp_path / "resumed", nproc, *args[len(TINY):], "--load", str(ck), "--save", str(ck))
    assert "(iteration 4)" in out.stdout
    assert_same_continuation(straight, resumed, 4)


def test_dp_size_change_keeps_model_optimizer_and_data_position(tmp_path):
    """ZeRO-1 saved at DP2, resumed at DP1 (same global batch): same continuation (dropout 0, so the
    DP size does not change which dropout masks a sample sees)."""
    ten = ["--train-iters", "10", "--eval-interval", "5", "--zero-1-memory-optimization"]
    straight, _ = run_engine(tmp_path / "dp2", 2, *ten, "--save", str(tmp_path / "s"), "--save-interval", "5",
                             torchrun=False)
    ck = resume_from(tmp_path / "s", 5, tmp_path / "ck")
    resumed, proc = run_engine(tmp_path / "dp1", 1, *ten, "--load", str(ck))
    assert "'dp': 2" in proc.stdout and "'dp': 1" in proc.stdout and "start fresh" not in proc.stdout
    assert_same_continuation(straight, resumed, 5, rel=1e-5)


@pytest.mark.parametrize("zero", [
    pytest.param(["--zero-1-memory-optimization", "--dist-ckpt-optim-fully-reshardable"], id="zero1_fully_reshardable"),
    # slow for CI time: the rule that keeps a dense ZeRO-0 run's optimizer state at another TP is in
    # test_what_a_tp2_checkpoint_restores_at_tp1
    pytest.param([], marks=pytest.mark.slow, id="zero0")])
def test_optimizer_state_moves_from_tp2_to_dp2(tmp_path, zero):
    """ZeRO-1 saved with --dist-ckpt-optim-fully-reshardable (or ZeRO-0) at TP2 x DP1, resumed at TP1 x DP2 with its
    optimizer state and lr schedule: the continuation of the run that never stopped (fp32, within 1e-5)."""
    ten = ["--train-iters", "10", "--eval-interval", "5", "--lr", "1e-3", *zero]
    straight, _ = run_engine(tmp_path / "tp2", 2, *ten, "--tensor-model-parallel-size", "2", "--save",
                             str(tmp_path / "s"), "--save-interval", "5", torchrun=False)
    ck = resume_from(tmp_path / "s", 5, tmp_path / "ck")
    assert json.load(open(ck / "iter_0000005" / "checkpoint.json")).get("optimizer_sharding") == (
        "fully_reshardable" if zero else None)
    resumed, proc = run_engine(tmp_path / "dp2", 2, *ten, "--load", str(ck), torchrun=False)
    assert "'tp': 2" in proc.stdout and "weights resharded" in proc.stdout, proc.stdout[-2000:]
    assert "optimizer and lr schedule start fresh" not in proc.stdout
    assert_same_continuation(straight, resumed, 5, rel=1e-5)


MOE = ["--model-family", "mixtral", "--num-experts", "4", "--moe-router-topk", "2"]
FULLY = ["--zero-1-memory-optimization", "--dist-ckpt-optim-fully-reshardable"]


@pytest.mark.parametrize("ep,zero", [
    pytest.param(1, FULLY, id="ep1_zero1_fully_reshardable"),
    pytest.param(4, FULLY, marks=pytest.mark.slow, id="ep4_zero1_fully_reshardable"),  # 4 processes
    pytest.param(1, [], marks=pytest.mark.slow, id="ep1_zero0")])
def test_moe_optimizer_state_moves_from_ep2(tmp_path, ep, zero):
    """An MoE run saved at EP2 x DP2 with its optimizer state, resumed at EP1 x DP2 or EP4 x DP4: the optimizer state
    and lr schedule are restored (the experts' state is a part of its own at every EP, compat.moe.expert_params_apart)
    and the run continues as the one that never stopped (fp32, within 1e-5)."""
    ten = ["--train-iters", "6", "--eval-interval", "3", "--lr", "1e-3", *MOE, *zero]
    straight, _ = run_engine(tmp_path / "ep2", 2, *ten, "--expert-model-parallel-size", "2", "--save",
                             str(tmp_path / "s"), "--save-interval", "3", torchrun=False)
    ck = resume_from(tmp_path / "s", 3, tmp_path / "ck")
    assert json.load(open(ck / "iter_0000003" / "checkpoint.json")).get("experts_apart") is True
    resumed, proc = run_engine(tmp_path / f"ep{ep}", max(ep, 2), *ten, "--load", str(ck),
                               "--expert-model-parallel-size", str(ep), torchrun=False)
    assert "'ep': 2" in proc.stdout and f"'ep': {ep}" in proc.stdout, proc.stdout[-2000:]
    assert "start fresh" not in proc.stdout.replace("RNG streams start fresh", "")
    assert_same_continuation(straight, resumed, 3, rel=1e-5)


def test_incomplete_newest_checkpoint_falls_back_to_previous(single, tmp_path):
    d, _, _ = single
    ck = resume_from(d / "ck", 10, tmp_path / "ck")
    data = next(f for f in os.listdir(ck / "iter_0000010") if f.endswith(".distcp"))
    with open(ck / "iter_0000010" / data, "r+b") as f:
        f.truncate(100)
    lines, proc = run_engine(tmp_path / "a", 1, *TEN, "--load", str(ck), "--skip-train")
    assert f"{ck}/iter_0000010 is incomplete ({data} has 100 bytes" in proc.stdout
    assert f"instead: {ck}/iter_0000008" in proc.stdout and "(iteration 8)" in proc.stdout
    for i in (6, 8):
        os.remove(ck / f"iter_000000{i}" / "checkpoint.json")
    _, proc = run_engine(tmp_path / "b", 1, *TEN, "--load", str(ck), "--skip-train", check=False)
    assert proc.returncode != 0 and "holds no earlier complete checkpoint" in proc.stderr


def test_load_path_checks(tmp_path):
    """A mistyped --load and an unreadable tracker are refused (an empty --load directory starts from scratch:
    test_evaluations_walk_through_the_validation_set trains from one)."""
    _, proc = run_engine(tmp_path / "a", 1, "--train-iters", "1", "--load", str(tmp_path / "typo"), check=False)
    assert proc.returncode != 0 and f"--load {tmp_path / 'typo'} does not exist" in proc.stderr
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "latest_checkpointed_iteration.txt").write_text("release\n")
    _, proc = run_engine(tmp_path / "c", 1, "--train-iters", "1", "--load", str(tmp_path / "bad"), check=False)
    assert proc.returncode != 0 and "expected an iteration number" in proc.stderr


def test_unwritable_save_is_refused_before_training(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    lines, proc = run_engine(tmp_path, 1, "--save", str(tmp_path / "file" / "ck"), check=False)
    assert proc.returncode != 0 and "is not a writable directory" in proc.stderr
    assert train_losses(lines) == []


class Payload:
    """Unpickling this creates a marker file: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_planted_pickle_is_refused(single, tmp_path):
    import pickle

    d, _, _ = single
    ck = resume_from(d / "ck", 10, tmp_path / "ck")
    marker = tmp_path / "pwned"
    path = ck / "iter_0000010" / ".metadata"
    path.write_bytes(pickle.dumps(Payload(str(marker))))
    (ck / "iter_0000010" / "checkpoint.json").write_text(  # keep the inventory consistent with the planted file
        json.dumps(dict(json.loads((ck / "iter_0000010" / "checkpoint.json").read_text()),
                        files={k: os.path.getsize(ck / "iter_0000010" / k) for k in os.listdir(ck / "iter_0000010")
                               if k != "checkpoint.json"})))
    _, proc = run_engine(tmp_path / "a", 1, *TEN, "--load", str(ck), "--skip-train", check=False)
    assert proc.returncode != 0 and "refused to unpickle _io.open" in proc.stderr
    assert not marker.exists()


def test_planted_object_in_checkpoint_data_is_refused(tmp_path):
    """A non-tensor entry of a DCP checkpoint is loaded with weights_only=True."""
    script = f"""
import io, pickle, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
import torch, torch.distributed.checkpoint as dcp
from test_engine_checkpoint import Payload
from megatron_patch.compat.safe_loading import load_dcp_objects_weights_only
dcp.save({{"rng": Payload({str(tmp_path / 'pwned')!r}), "w": torch.ones(2)}}, checkpoint_id={str(tmp_path / 'ck')!r}, no_dist=True)
load_dcp_objects_weights_only()
state = {{"rng": None, "w": torch.zeros(2)}}
try:
    dcp.load(state, checkpoint_id={str(tmp_path / 'ck')!r}, no_dist=True)
except BaseException as e:  # DCP's CheckpointException is a BaseException
    print("refused:", type(e).__name__, str(e))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert "refused:" in proc.stdout and "Weights only load failed" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("name,nproc,layout", [
    # slow for CI time (make test-all): in the default lane, TP2 weights resharded to TP1 (x DP2) continue the
    # uninterrupted run, validation loss included (test_optimizer_state_moves_from_tp2_to_dp2)
    pytest.param("tp1", 1, [], marks=pytest.mark.slow, id="tp1"),
    pytest.param("tp2pp2", 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
                 marks=pytest.mark.slow, id="tp2pp2")])
def test_reshard_tp2_checkpoint(tmp_path, name, nproc, layout):
    """A TP2 checkpoint loaded at another layout gives the validation loss it gives at TP2: the TP2 run's own
    evaluation at iteration 5 (after its last step, on the weights it then saves), on the same validation batches
    (the checkpoint's validation position rewound to them)."""
    saved, _ = run_engine(tmp_path / "tp2", 2, "--tensor-model-parallel-size", "2", "--save", str(tmp_path / "ck"),
                          torchrun=False)
    rewind_validation(tmp_path / "ck" / "iter_0000005")
    lines, proc = run_engine(tmp_path / name, nproc, *layout, "--load", str(tmp_path / "ck"), "--skip-train",
                             torchrun=False)
    assert "weights resharded" in proc.stdout, proc.stdout[-2000:]
    assert valid_losses(lines)[-1] == pytest.approx(valid_losses(saved)[-1], rel=1e-5)


def test_evaluations_walk_through_the_validation_set(tmp_path):
    """With a zero learning rate the model stays the same, so each evaluation's loss differs only because
    it reads the next validation batches (Megatron-LM's behaviour), not the first ones again. The run's --load
    is an empty directory: it starts from scratch (said in the log) rather than refusing."""
    (tmp_path / "empty").mkdir()
    lines, proc = run_engine(tmp_path, 1, "--lr", "0", "--train-iters", "3", "--eval-interval", "1", "--eval-iters", "1",
                             "--load", str(tmp_path / "empty"))
    assert "starting from scratch" in proc.stdout and len(train_losses(lines)) == 3
    losses = valid_losses(lines)
    assert len(losses) == 3 and len(set(losses)) == 3, losses


# ---------------------------------------------------------------- resume semantics (Megatron-LM's rules)
# The `single` run's schedule: lr 1e-4, linear decay over its --train-iters 10 (80 samples of global batch 8) to
# --min-lr 0, no warmup, --weight-decay 0.01; its checkpoints are at iterations 6, 8 and 10.

def refusal(*argv: str, world: int = 1) -> str:
    """The configuration error validate() gives these flags (before any process starts), '' when it accepts them."""
    from megatron_patch.config import ConfigError, parse_args

    try:
        parse_args([*TINY, *TEN, *argv]).validate(world)
    except ConfigError as e:
        return str(e)
    return ""


SCHEDULE_CHANGES = {  # flags -> what the refusal says about them (the checkpoint's value, this run's, the flag)
    "train_iters": (["--train-iters", "20"],
                    "lr decay over 10 iterations in the checkpoint, 20 here: --train-iters 20 (--lr-decay-iters defaults to it)"),
    "lr": (["--lr", "2e-4"], "--lr 0.0001 in the checkpoint, 0.0002 here"),
    "min_lr": (["--min-lr", "1e-5"], "--min-lr 0 in the checkpoint, 1e-05 here"),
    "decay_iters": (["--lr-decay-iters", "20"], "lr decay over 10 iterations in the checkpoint, 20 here: --lr-decay-iters 20"),
    "decay_style": (["--lr-decay-style", "cosine"], "--lr-decay-style linear in the checkpoint, cosine here"),
    "warmup_iters": (["--lr-warmup-iters", "2"], "warmup 0 iterations in the checkpoint, 2 here: --lr-warmup-iters 2"),
    "warmup_fraction": (["--lr-warmup-fraction", "0.3"],
                        "warmup 0 iterations in the checkpoint, 3 here: --lr-warmup-fraction 0.3 of the decay"),
    "weight_decay": (["--weight-decay", "0.1"], "--weight-decay 0.01 in the checkpoint, 0.1 here"),
    # the schedule counts samples: the same iterations of a larger global batch decay over more samples
    "global_batch": (["--global-batch-size", "16"],
                     "lr decay over 10 iterations of 8 samples in the checkpoint, of 16 samples here: --global-batch-size 16"),
    # the scheduler's fields agree, but the decay ended where the checkpoint's run did: 11-20 would train at lr 0
    "past_decay": (["--train-iters", "20", "--lr-decay-iters", "10"],
                   "--train-iters 20 runs past the end of the checkpoint's lr decay (iteration 10, where its run of "
                   "--train-iters 10 ended): iterations 11-20 would train at --min-lr 0"),
}


@pytest.mark.parametrize("change", list(SCHEDULE_CHANGES))
def test_resume_refuses_a_changed_schedule(single, change):
    """Each schedule flag that differs from the checkpoint's is refused in one line naming both values and the
    flag; --override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler each accept it. (In-process
    validate(): milliseconds.)"""
    d, _, _ = single
    flags, says = SCHEDULE_CHANGES[change]
    longer = " and --lr-decay-iters 20" if change == "past_decay" else ""
    assert refusal("--load", str(d / "ck"), *flags) == (
        f"--load {d / 'ck'} (iteration 10) continues a learning-rate schedule that this run's flags change: {says}. "
        f"Pass --override-opt-param-scheduler{longer} to continue from iteration 10 with this run's schedule, or "
        f"--use-checkpoint-opt-param-scheduler to keep the checkpoint's")
    assert refusal("--load", str(d / "ck"), *flags, "--override-opt-param-scheduler") == ""
    assert refusal("--load", str(d / "ck"), *flags, "--use-checkpoint-opt-param-scheduler") == ""
    assert refusal("--load", str(d / "ck"), *flags, "--no-load-optim") == ""  # no schedule loaded: nothing to compare


def test_resume_schedule_checks_what_is_restored(single, tmp_path):
    """No refusal where no schedule is loaded (a weights-only checkpoint, as converted from Hugging Face) or where
    nothing differs; a shorter run inside the same decay is no change of schedule. The scheduler flags are refused
    where they cannot act."""
    d, _, _ = single
    ck = str(d / "ck")
    assert refusal("--load", ck) == ""
    assert refusal("--load", ck, "--train-iters", "8", "--lr-decay-iters", "10") == ""
    model_only = resume_from(d / "ck", 10, tmp_path / "ck")
    manifest = model_only / "iter_0000010" / "checkpoint.json"
    manifest.write_text(json.dumps(dict(json.loads(manifest.read_text()), contents=["model"], scheduler=None)))
    assert refusal("--load", str(model_only), "--train-iters", "20", "--lr", "2e-4") == ""
    assert refusal("--load", ck, "--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler") == (
        "--override-opt-param-scheduler takes this run's schedule, --use-checkpoint-opt-param-scheduler the "
        "checkpoint's: pass only one")
    assert refusal("--override-opt-param-scheduler") == (
        "--override-opt-param-scheduler: it applies when resuming with --load; drop the flag")
    assert refusal("--load", ck, "--no-load-optim", "--use-checkpoint-opt-param-scheduler") == (
        "--use-checkpoint-opt-param-scheduler: --no-load-optim loads no schedule; drop the flag")


def test_changed_schedule_exits_2_in_one_line_before_launch(single):
    """The entry point as torchrun's workers run it: one `configuration error:` line, exit status 2, no traceback.
    (One Python start, no process group: about 3 s.)"""
    d, _, _ = single
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_megatron_gpt.py"), *TINY, *TEN, "--load",
                           str(d / "ck"), "--train-iters", "20"], capture_output=True, text=True, cwd=str(d),
                          env=dict(os.environ, PYTHONWARNINGS="ignore"), timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"configuration error: --load {d / 'ck'} (iteration 10) continues a learning-rate "
                                  f"schedule that this run's flags change: lr decay over 10 iterations")


def expected_lr(iteration: int, lr: float, min_lr: float, warmup: int, decay: int, style: str) -> float:
    """Megatron's schedule, written out: the rate step `iteration` (from 1) uses, after iteration - 1 steps."""
    done = iteration - 1
    if warmup and done <= warmup:
        return lr * done / warmup
    if done > decay:
        return min_lr
    ratio = (done - warmup) / (decay - warmup)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1) if style == "cosine" else 1 - ratio
    return min_lr + coeff * (lr - min_lr)


def test_override_continues_with_the_new_schedule(single, tmp_path):
    """--override-opt-param-scheduler from iteration 6: iterations 7-12 use the rates of the new flags' schedule
    at those iterations (computed here from the formula), and iteration 7 still starts from the checkpoint's
    weights (its loss is the straight run's). (6 iterations, one process: about 15 s.)"""
    d, straight, _ = single
    ck = resume_from(d / "ck", 6, tmp_path / "ck")
    new = dict(lr=2e-4, min_lr=2e-5, warmup=2, decay=12, style="cosine")
    resumed, proc = run_engine(tmp_path, 1, *TEN, "--load", str(ck), "--train-iters", "12", "--lr", "2e-4",
                               "--min-lr", "2e-5", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
                               "--override-opt-param-scheduler")
    assert "(iteration 6); lr schedule: this run's flags (--override-opt-param-scheduler)" in proc.stdout
    lrs = {x["iteration"]: x["lr"] for x in resumed if "lr" in x}
    assert sorted(lrs) == list(range(7, 13))
    for i, lr in lrs.items():
        assert lr == pytest.approx(expected_lr(i, **new), rel=1e-12), i
    assert lrs[7] != pytest.approx(expected_lr(7, 1e-4, 0.0, 0, 10, "linear"))  # not the checkpoint's schedule
    assert train_losses(resumed)[0] == pytest.approx(train_losses(straight)[6], rel=1e-6)


def test_use_checkpoint_keeps_the_old_schedule(single, tmp_path):
    """--use-checkpoint-opt-param-scheduler with other --lr/--min-lr/style: iterations 7-10 continue exactly as the
    uninterrupted run (its rates, losses and grad norms). (4 iterations: about 12 s.)"""
    d, straight, _ = single
    ck = resume_from(d / "ck", 6, tmp_path / "ck")
    resumed, proc = run_engine(tmp_path, 1, *TEN, "--load", str(ck), "--lr", "5e-4", "--min-lr", "1e-5",
                               "--lr-decay-style", "cosine", "--use-checkpoint-opt-param-scheduler")
    assert "lr schedule: the checkpoint's (--use-checkpoint-opt-param-scheduler: --lr 0.0001" in proc.stdout
    assert_same_continuation(straight, resumed, 6)


# ---------------------------------------------------------------- --save never takes over another run's checkpoints

def test_save_into_another_runs_checkpoints_is_refused(single, tmp_path):
    """A --save directory with checkpoints is written only by the run that resumes it (--load is the same
    directory): another run, of this model and layout or not, is refused in one line naming what differs.
    (In-process validate(): milliseconds.)"""
    d, _, _ = single
    ck = d / "ck"
    tail = (f": a run never writes over another run's checkpoints. Resume that run with --load {ck}, or choose a new "
            f"--save directory (pretrain_scripts/run_gpt.sh: OUTPUT=DIR)")
    assert refusal("--save", str(ck)) == f"--save {ck} already holds checkpoints of this model and layout (iteration 10)" + tail
    assert refusal("--save", str(ck), "--tensor-model-parallel-size", "2", world=2) == (
        f"--save {ck} already holds the checkpoints of another run (iteration 10; TP 1 there, 2 here)" + tail)
    assert refusal("--save", str(ck), "--hidden-size", "32", "--zero-1-memory-optimization") == (
        f"--save {ck} already holds the checkpoints of another run (iteration 10; --hidden-size 64 there, 32 here, "
        f"ZeRO 0 there, 1 here)" + tail)
    (tmp_path / "empty").mkdir()
    assert refusal("--load", str(tmp_path / "empty"), "--save", str(ck)).startswith(f"--save {ck} already holds")
    # accepted: resuming in place (the same directory, however written), an empty or new directory, --skip-train
    assert refusal("--load", str(ck), "--save", os.path.join(str(d), ".", "ck")) == ""
    assert refusal("--save", str(tmp_path / "new")) == "" and refusal("--save", str(tmp_path / "empty")) == ""
    assert refusal("--save", str(ck), "--skip-train") == ""


def test_save_takeover_exits_2_in_one_line_before_launch(single):
    """--validate-only for 2 processes (what the launchers run before torchrun): exit 2, one line."""
    d, _, _ = single
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_megatron_gpt.py"), *TINY, *TEN,
                           "--tensor-model-parallel-size", "2", "--save", str(d / "ck"), "--validate-only"],
                          capture_output=True, text=True, cwd=str(d),
                          env=dict(os.environ, PYTHONWARNINGS="ignore", WORLD_SIZE="2"), timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"configuration error: --save {d / 'ck'} already holds the checkpoints of another "
                                  f"run (iteration 10; TP 1 there, 2 here)")


@pytest.mark.parametrize("zero,world,flags,restored", [
    (0, 1, [], True),  # without ZeRO the optimizer state follows the model's sharded tensors to any TP/PP
    (1, 2, ["--zero-1-memory-optimization"], False),  # dp_reshardable: DP changes only
    (1, 2, ["--zero-1-memory-optimization", "--dist-ckpt-optim-fully-reshardable"], True),
], ids=["zero0", "zero1", "zero1_fully_reshardable"])
def test_what_a_tp2_checkpoint_restores_at_tp1(zero, world, flags, restored):
    """config/resume.py's rule for a dense model's TP2 checkpoint resumed at TP1 (a dense model has no expert layout:
    the optimizer state of a ZeRO-0 run, or of a fully reshardable ZeRO-1 one, is kept)."""
    from megatron_patch.config import parse_args
    from megatron_patch.config.resume import restores

    cfg = parse_args([*TINY, *TEN, *flags]).validate(world)
    manifest = {"layout": {"tp": 2, "pp": 1, "dp": 1, "vpp": 1, "zero": zero},
                "contents": ["model", "optimizer", "rng", "scheduler"],
                **({"optimizer_sharding": "fully_reshardable"} if "--dist-ckpt-optim-fully-reshardable" in flags
                   else {})}
    r = restores(manifest, cfg)
    assert (r.same_model_layout, r.optimizer) == (False, restored)


@pytest.mark.parametrize("saved_ep,apart,restored", [
    (2, True, True),  # written with the experts apart: their state moves to EP1
    (2, False, False),  # an older EP2 checkpoint: not known to match this run's optimizer parts
    (1, False, False),  # an older EP1 checkpoint kept the experts with the dense parameters
    (1, True, True),
], ids=["ep2_apart", "ep2_older", "ep1_older", "ep1_apart"])
def test_what_an_moe_checkpoint_restores_at_ep1(saved_ep, apart, restored):
    """config/resume.py's rule for an MoE checkpoint resumed at EP1 with ZeRO-1 fully reshardable."""
    from megatron_patch.config import parse_args
    from megatron_patch.config.resume import restores

    cfg = parse_args([*TINY, *TEN, *MOE, *FULLY]).validate(2)
    manifest = {"layout": {"tp": 1, "pp": 1, "dp": 2, "vpp": 1, "zero": 1, "ep": saved_ep, "etp": 1},
                "contents": ["model", "optimizer", "rng", "scheduler"], "optimizer_sharding": "fully_reshardable",
                **({"experts_apart": True} if apart else {})}
    assert restores(manifest, cfg).optimizer == restored


def test_fully_reshardable_needs_zero_1():
    assert "--dist-ckpt-optim-fully-reshardable is the format of the distributed optimizer's state" in refusal(
        "--dist-ckpt-optim-fully-reshardable")
    assert refusal("--dist-ckpt-optim-fully-reshardable", "--zero-1-memory-optimization") == ""
