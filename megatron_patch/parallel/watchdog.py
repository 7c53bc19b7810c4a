"""Hang detection: a worker that stops (SIGSTOP, a frozen machine, a dead node whose process never exited) or a step
that never ends stops the whole job within a stated bound, naming the rank and what it was doing.

Three mechanisms bound a hang, and each is needed somewhere:
- the collectives' own timeout, `--distributed-timeout-minutes` given to init_process_group: gloo raises in a rank
  whose send/recv waits longer; NCCL's watchdog thread aborts the communicator (TORCH_NCCL_ASYNC_ERROR_HANDLING);
- this module's heartbeat: every worker runs a thread that publishes a heartbeat (a counter, the iteration and the
  phase: "train step", "checkpoint save", ...) to the rendezvous store every few seconds and reads the others'. A
  worker whose counter has not moved for --heartbeat-timeout-seconds (default 60; shorter than the collectives'
  timeout, so the heartbeat speaks first) is stopped or gone (its threads stopped with it): the worker watching it
  prints one line naming it and exits with status 1. With --step-timeout-minutes, a worker whose progress mark (set
  at each step, save and evaluation) is older than that ends the job the same way, naming its position and its
  neighbour's (a hung collective or a rank in an endless loop: all heartbeats move, no progress);
- the launcher: torchrun, seeing a worker exit non-zero, sends the others SIGTERM and SIGKILL 30 s later (a stopped
  process takes only SIGKILL), so nothing is left running; with --max-restarts it starts the job again. The watcher
  kills a stopped worker of its own torchrun agent (same machine, same parent process) itself, at once.

So a stopped worker ends the job within --heartbeat-timeout-seconds + 2 x HEARTBEAT_SECONDS (detection), plus
torchrun's 30 s SIGTERM grace when it runs on another machine than its watcher, on gloo and NCCL alike; a collective that never completes among live workers, within
--distributed-timeout-minutes (the backend's timeout) or --step-timeout-minutes, whichever is shorter. The heartbeat uses a client of the rendezvous store (under
torchrun the agent hosts it, so it answers while any worker is stopped); keys are under the attempt's prefix.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

HEARTBEAT_SECONDS = 2.0  # how often a worker publishes its heartbeat and reads the others'
_HOST = socket.gethostname()


class Watchdog:
    """One per worker: `start()` the thread, `mark(iteration, phase)` from the training loop, `stop()` at the end.

    Each worker publishes its own record and watches one other: the next rank that has not finished (a ring), so the
    store serves one write per mark and one read per heartbeat per worker, at any world size; a stopped worker is
    named by the worker before it. Each worker checks its own step time against --step-timeout-minutes."""

    def __init__(self, store, rank: int, world: int, heartbeat_timeout_s: float,
                 step_timeout_s: Optional[float] = None, every_s: float = HEARTBEAT_SECONDS) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.heartbeat_timeout_s, self.step_timeout_s = heartbeat_timeout_s, step_timeout_s
        self.every_s = min(every_s, heartbeat_timeout_s / 4)
        self._beat = 0
        self._iteration, self._phase, self._marked = 0, "start-up", time.monotonic()
        self._seen: Dict[int, Tuple[int, float]] = {}  # rank -> (its last beat counter, when it changed, our clock)
        self._records: Dict[int, dict] = {}
        self._started = time.monotonic()
        self._store_lost: Optional[float] = None  # since when the store has not answered
        self._done, self._wake = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="megatron_patch-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._publish()
        self._thread.start()
        return self

    def mark(self, iteration: int, phase: str) -> None:
        """Progress: this worker starts `phase` ("train step", "checkpoint save", "evaluation") of `iteration`. The
        thread publishes it at once (the main thread never waits for the store)."""
        self._iteration, self._phase, self._marked = iteration, phase, time.monotonic()
        self._wake.set()

    def stop(self) -> None:
        """A worker that finished says so: the others no longer expect its heartbeat."""
        self._done.set()
        self._wake.set()
        try:
            self._publish(done=True)
        except Exception:  # the store may be gone with a finished rank 0: nothing more to tell anyone
            pass

    # ---- the thread ---------------------------------------------------------------------------------------------
    def _key(self, rank: int) -> str:
        return f"heartbeat{rank}"

    def _publish(self, done: bool = False) -> None:
        self._beat += 1
        self.store.set(self._key(self.rank), json.dumps({
            "beat": self._beat, "iteration": self._iteration, "phase": self._phase, "done": done,
            "in_phase_s": round(time.monotonic() - self._marked, 1), "host": _HOST, "pid": os.getpid(),
            "ppid": os.getppid()}))

    def _run(self) -> None:
        next_check = time.monotonic() + self.every_s
        while not self._done.is_set():
            self._wake.wait(max(0.0, next_check - time.monotonic()))
            self._wake.clear()
            if self._done.is_set():
                return
            verdict = None
            try:
                self._publish()
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + self.every_s
                    verdict = self._verdict()
                self._store_lost = None
            except Exception as e:  # the store stopped answering: its host stopped, or a finished rank 0 took it
                if self._done.is_set() or any(r.get("done") for r in self._records.values()):
                    return
                # A rank 0 that finished first (without torchrun it hosts the store) takes the store with it while
                # this worker is still finishing: only a store silent for the heartbeat timeout ends the job.
                self._store_lost = self._store_lost or time.monotonic()
                if time.monotonic() - self._store_lost > self.heartbeat_timeout_s:
                    verdict = (f"the rendezvous store at {os.environ.get('MASTER_ADDR')}:"
                               f"{os.environ.get('MASTER_PORT')} has not answered for "
                               f"{time.monotonic() - self._store_lost:.0f} s ({type(e).__name__}: {e}); the worker "
                               "hosting it (rank 0 without torchrun) may be stopped", [])
            if verdict is not None and not self._done.is_set():
                self._end(*verdict)

    def _watched(self) -> Optional[int]:
        """The next rank after this one that has not finished (reading its record), None when all others have."""
        now = time.monotonic()
        for k in range(1, self.world):
            r = (self.rank + k) % self.world
            if not self.store.check([self._key(r)]):
                return r  # not started yet: its silence counts from our start
            rec = json.loads(self.store.get(self._key(r)))
            self._records[r] = rec
            if r not in self._seen or self._seen[r][0] != rec["beat"]:
                self._seen[r] = (rec["beat"], now)
            if not rec.get("done"):
                return r
        return None

    def _verdict(self) -> Optional[Tuple[str, List[int]]]:
        """(the message, the ranks it blames) when the job must end; None while all is well."""
        peer = self._watched()
        now = time.monotonic()
        if peer is not None:
            since = now - self._seen.get(peer, (0, self._started))[1]
            if since > self.heartbeat_timeout_s:
                return (f"rank {peer} has sent no heartbeat for {since:.0f} s{self._where(peer)} "
                        f"(--heartbeat-timeout-seconds {self.heartbeat_timeout_s:g}): the process is stopped, frozen "
                        "or its machine is gone", [peer])
        in_phase = now - self._marked
        if self.step_timeout_s and self._phase != "start-up" and in_phase > self.step_timeout_s:
            mine = {"iteration": self._iteration, "phase": self._phase, "in_phase_s": in_phase}
            other = (f"; rank {peer} reports {self._position(self._records[peer])}"
                     if peer is not None and peer in self._records else "")
            return (f"rank {self.rank} has spent longer than --step-timeout-minutes {self.step_timeout_s / 60:g} in "
                    f"{self._position(mine)}{other}: a hung collective, or a rank that does not reach it", [self.rank])
        return None

    @staticmethod
    def _position(rec: dict) -> str:
        return f"iteration {rec['iteration']}, {rec['phase']} for {rec['in_phase_s']:.0f} s"

    def _where(self, r: int) -> str:
        rec = self._records.get(r)
        return f" (its last report: {self._position(rec)})" if rec else " (it never reported)"

    def _end(self, message: str, blamed: List[int]) -> None:
        """Say why and exit with status 1: torchrun then stops the other workers (the main thread is blocked in a
        collective or a stalled step: it cannot be unwound). A blamed worker started by the same torchrun agent on
        this machine (same host, same parent) is killed first: a stopped process takes only SIGKILL, which torchrun
        sends 30 s after its SIGTERM."""
        for r in blamed:
            rec = self._records.get(r, {})
            if r != self.rank and rec.get("host") == _HOST and rec.get("ppid") == os.getppid() and rec.get("pid"):
                try:
                    os.kill(rec["pid"], signal.SIGKILL)
                    message += f"; rank {r} (pid {rec['pid']}, this machine) killed"
                except OSError:
                    pass
        print(f"error: hang detected by rank {self.rank}: {message}. Ending the job (exit status 1); torchrun stops "
              "the remaining workers.", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


_WATCHDOG: Optional[Watchdog] = None


def start_watchdog(heartbeat_timeout_s: float, step_timeout_s: Optional[float] = None) -> Optional[Watchdog]:
    """Start this worker's watchdog (several workers only; none in a world of one). Keys live under the restart
    attempt's prefix of the rendezvous store."""
    global _WATCHDOG
    stop_watchdog()
    world = dist.get_world_size()
    if world == 1:
        return None
    from megatron_patch.config.restart import restart_count

    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=datetime.timedelta(seconds=max(10.0, heartbeat_timeout_s / 2)))
    store = dist.PrefixStore(f"watchdog/attempt{restart_count()}", client)
    _WATCHDOG = Watchdog(store, dist.get_rank(), world, heartbeat_timeout_s, step_timeout_s).start()
    return _WATCHDOG


def mark(iteration: int, phase: str) -> None:
    """Progress of this worker (no-op without a watchdog)."""
    if _WATCHDOG is not None:
        _WATCHDOG.mark(iteration, phase)


def stop_watchdog() -> None:
    global _WATCHDOG
    if _WATCHDOG is not None:
        _WATCHDOG.stop()
        _WATCHDOG = None
