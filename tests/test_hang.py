"""Hang detection (parallel/watchdog.py): one of two torchrun workers stopped with SIGSTOP mid-run ends the job with a
non-zero status within the stated bound (--heartbeat-timeout-seconds + 2 heartbeats; its watcher on the same machine
kills it), the message naming rank 1 and where it was, and the stopped process gone. The verdicts themselves (a silent rank, a
finished rank, a step past --step-timeout-minutes) are checked on a store shared by two watchdogs in one process."""
from __future__ import annotations

import os
import re
import sys
import time

import pytest
import torch.distributed as dist

from engine_utils import ROOT, TINY, free_port, run_in_group
from megatron_patch.config import ConfigError
from megatron_patch.config.arguments import parse_args
from megatron_patch.parallel.watchdog import Watchdog

# timed against the wall clock: `make test` runs these alone, after the lane's two parallel workers
pytestmark = pytest.mark.serial


def _pair(heartbeat_s=0.5, step_s=None):
    """Two watchdogs on one store, their threads not started: the test publishes and asks for verdicts."""
    store = dist.HashStore()
    dogs = [Watchdog(store, r, 2, heartbeat_s, step_s) for r in range(2)]
    for w in dogs:
        w._publish()
    return dogs


def test_a_silent_rank_is_named_with_its_last_position():
    w0, w1 = _pair()
    w1.mark(4, "train step")
    w1._publish()  # its last heartbeat; then it says nothing more (a stopped process)
    assert w0._verdict() is None
    time.sleep(0.3)
    w0._publish()
    assert w0._verdict() is None  # 0.3 s of silence: within the 0.5 s timeout
    time.sleep(0.4)
    message, blamed = w0._verdict()
    assert blamed == [1]
    assert message.startswith("rank 1 has sent no heartbeat for 1 s (its last report: iteration 4, train step")
    assert "--heartbeat-timeout-seconds 0.5" in message


def test_a_beating_rank_is_not_named_and_a_finished_rank_is_not_expected():
    w0, w1 = _pair()
    for _ in range(8):  # 0.8 s: longer than the timeout, but rank 1 keeps beating
        time.sleep(0.1)
        w1._publish()
        assert w0._verdict() is None
    w1.stop()  # finished: its heartbeat stops for good
    assert w0._verdict() is None  # (its last record, "done", is read)
    time.sleep(0.7)
    assert w0._verdict() is None


def test_a_step_past_the_step_timeout_is_named_with_the_neighbours_position():
    w0, w1 = _pair(heartbeat_s=5.0, step_s=0.3)
    w0.mark(7, "train step")
    w1.mark(7, "checkpoint save")
    w1._publish()
    assert w0._verdict() is None
    time.sleep(0.4)
    w1._publish()
    message, blamed = w0._verdict()
    assert blamed == [0]
    assert message == ("rank 0 has spent longer than --step-timeout-minutes 0.005 in iteration 7, train step for 0 s; "
                       "rank 1 reports iteration 7, checkpoint save for 0 s: a hung collective, or a rank that does "
                       "not reach it")
    w0.mark(8, "train step")  # progress again; rank 1 is still late, and says so itself
    assert w0._verdict() is None
    assert w1._verdict()[1] == [1]


def test_a_store_gone_with_a_finished_rank_0_is_given_the_heartbeat_timeout():
    """Without torchrun rank 0 hosts the store: when it finishes first, a worker still finishing must not end the job
    for a missing store at once; only a store silent for the heartbeat timeout does."""
    class Gone:
        def set(self, *a):
            raise RuntimeError("Connection reset by peer")

        check = get = set

    w = Watchdog(Gone(), 1, 2, heartbeat_timeout_s=0.6, every_s=0.05)
    ended = []
    w._end = lambda message, blamed: (ended.append(message), w._done.set())
    w._thread.start()
    time.sleep(0.3)
    assert not ended  # within the timeout (the worker's own stop() would end the thread quietly)
    time.sleep(0.7)
    w._done.set()
    assert ended and "has not answered for" in ended[0], ended


@pytest.mark.parametrize("flags, words", [
    (["--heartbeat-timeout-seconds", "120", "--distributed-timeout-minutes", "1"],
     "--heartbeat-timeout-seconds 120 is not shorter than --distributed-timeout-minutes 1"),
    (["--step-timeout-minutes", "0"], "--step-timeout-minutes 0: give a positive time"),
])
def test_timeouts_are_checked_before_launch(flags, words):
    with pytest.raises(ConfigError, match=words):
        parse_args([*TINY, *flags], model="gpt").validate(1)


def test_a_stopped_worker_ends_the_job_naming_its_rank(tmp_path):
    stamp = tmp_path / "fault"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
           "--master-port", str(free_port()), os.path.join(ROOT, "tests", "fault_worker.py"), *TINY,
           "--train-iters", "50", "--eval-iters", "0", "--heartbeat-timeout-seconds", "6",
           "--distributed-timeout-minutes", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", FAULT_AT="3", FAULT_SIGNAL="SIGSTOP",
               FAULT_STAMP=str(stamp))
    proc = run_in_group(cmd, 240, cwd=str(tmp_path), env=env)
    ended = time.time()
    stopped_at, pid = stamp.read_text().split()
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "error: hang detected by rank 0: rank 1 has sent no heartbeat for " in out, out[-3000:]
    assert re.search(r"\(its last report: iteration 4, train step for \d+ s\) \(--heartbeat-timeout-seconds 6\)", out), \
        [x for x in out.splitlines() if "hang detected" in x]
    assert f"; rank 1 (pid {pid}, this machine) killed. Ending the job" in out  # its watcher's machine: no 30 s wait
    bound = 6 + 2 * 2  # the heartbeat timeout, two heartbeats to see it
    assert ended - float(stopped_at) < bound + 8  # + the launcher's own exit
    with pytest.raises(ProcessLookupError):  # the stopped worker was killed, not left behind
        os.kill(int(pid), 0)


@pytest.mark.slow
def test_a_rank_that_never_reaches_the_collective_ends_the_job_after_the_step_timeout(tmp_path):
    """(~25 s.) Rank 1 loops forever before iteration 4 (alive: its heartbeat goes on); rank 0 waits in the step's
    collective. --step-timeout-minutes 0.2 (12 s) ends the job, non-zero, naming the ranks' positions."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
           "--master-port", str(free_port()), os.path.join(ROOT, "tests", "fault_worker.py"), *TINY,
           "--train-iters", "50", "--eval-iters", "0", "--step-timeout-minutes", "0.2", "--heartbeat-timeout-seconds",
           "60", "--distributed-timeout-minutes", "5"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", FAULT_AT="3", FAULT_SIGNAL="LOOP",
               FAULT_STAMP=str(tmp_path / "fault"))
    proc = run_in_group(cmd, 240, cwd=str(tmp_path), env=env)
    ended = time.time()
    stopped_at, _ = (tmp_path / "fault").read_text().split()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert re.search(r"error: hang detected by rank [01]: rank [01] has spent longer than --step-timeout-minutes 0.2 "
                     r"in iteration 4, train step for 1\d s; rank [01] reports iteration 4, train step", out), out[-3000:]
    assert ended - float(stopped_at) < 12 + 2 * 2 + 35  # the timeout, two heartbeats, torchrun's SIGTERM grace
