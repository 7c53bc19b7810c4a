"""Run the pretraining entry point as users do (torchrun, several CPU processes with gloo; or, for tests of what the
processes compute, the same processes started directly: run_engine's torchrun=False) and read back its
per-iteration metrics and the full (unsharded) weights of its checkpoint.

Run as a script (by `run_counting_forwards_together`), this file trains like the entry point while counting the
forward calls of every transformer layer and core attention, one run after another in one process; by
`run_engines_in_one_process`, it runs the entry point's main() for several one-process runs in turn."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from typing import Dict, List

import pytest
import torch

from megatron_patch.ports import free_port  # noqa: F401 (the tests import it from here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ("--mock-data --vocab-size 128 --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 5 --lr 1e-4 --log-interval 1 --eval-interval 5 "
        "--eval-iters 2 --hidden-dropout 0 --attention-dropout 0 --init-layout-invariant --seed 7").split()


def run_engine(workdir, nproc: int, *args: str, base=TINY, check: bool = True, timeout: int = 900, script=None,
               torchrun: bool = None):
    """Run pretrain_megatron_gpt.py (or `script`: [path, its own arguments...]) under torchrun, or for one process
    plainly (`python pretrain_megatron_gpt.py`, the entry point's documented single-process launch, which saves
    torchrun's own start-up of about 2 s; torchrun=True keeps it); returns (metrics lines, completed process).
    torchrun=False with several processes: started directly, as torchrun starts its workers (the same RANK,
    LOCAL_RANK, WORLD_SIZE and MASTER_ADDR/PORT; all stopped when one fails), without torchrun's own process
    (about 1.5 s a launch, CI time) -- for tests of what the processes compute, not of how torchrun runs them."""
    os.makedirs(workdir, exist_ok=True)
    metrics = os.path.join(str(workdir), "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    entry = [*(script or [os.path.join(ROOT, "pretrain_megatron_gpt.py")]), *base, *args, "--metrics-file", metrics]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if nproc > 1 and torchrun is False:
        proc = _run_workers_directly(nproc, [sys.executable, *entry], str(workdir), env, timeout)
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                    str(free_port())] if nproc > 1 or torchrun else [sys.executable]
        proc = run_in_group([*launcher, *entry], timeout, cwd=str(workdir), env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"engine failed ({proc.returncode}): {' '.join(args)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    lines = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
    return lines, proc


def run_in_group(cmd: List[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs), with the command in a session
    of its own: at the timeout the whole group is killed (torchrun and the workers it started; subprocess.run kills
    only torchrun, which leaves its workers running into the next tests), then TimeoutExpired is raised."""
    import signal

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _run_workers_directly(nproc: int, cmd: List[str], cwd: str, env: Dict[str, str], timeout: int):
    """`cmd` as `nproc` workers of one gloo job, each with torchrun's environment of a single node; when one exits
    with an error the others are killed (as torchrun does). The completed process's output is rank 0's, then the
    others' in rank order, and its status that of the first worker that failed."""
    import tempfile
    import time

    port = str(free_port())
    workers = []
    for rank in range(nproc):
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                        GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        workers.append((subprocess.Popen(cmd, cwd=cwd, env=rank_env, stdout=out, stderr=err, text=True), out, err))
    deadline, failed = time.monotonic() + timeout, None
    try:
        while None in [p.poll() for p, _, _ in workers]:  # (every worker polled: poll() sets returncode)
            failed = next((p.returncode for p, _, _ in workers if p.returncode), None)
            if failed:  # one failed: the others would wait for it forever
                break
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(cmd, timeout)
            time.sleep(0.05)
    finally:
        for p, _, _ in workers:
            if p.poll() is None:
                p.kill()
            p.wait()
    texts = []
    for _, out, err in workers:
        out.seek(0), err.seek(0)
        texts.append((out.read(), err.read()))
        out.close(), err.close()
    status = failed or next((p.returncode for p, _, _ in workers if p.returncode), 0)
    return subprocess.CompletedProcess(cmd, status, "".join(o for o, _ in texts), "".join(e for _, e in texts))


def train_losses(lines: List[dict]) -> List[float]:
    return [x["loss"] for x in lines if "loss" in x]


def per_iteration(lines: List[dict], key: str) -> List[float]:
    """`key` of every training iteration (validation records have no loss)."""
    return [x[key] for x in lines if "loss" in x]


def _engine_jobs(workdir, runs: Dict[str, List[str]], base, ports: bool = False):
    """The jobs file of engine_utils.py --main: per run its arguments (metrics in workdir/name/metrics.jsonl), its
    directory, and with `ports` a rendezvous port of its own. Returns (jobs, the file's path)."""
    jobs = []
    for name, args in runs.items():
        os.makedirs(os.path.join(str(workdir), name), exist_ok=True)
        metrics = os.path.join(str(workdir), name, "metrics.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        jobs.append({"argv": [*base, *args, "--metrics-file", metrics], "cwd": os.path.join(str(workdir), name),
                     **({"port": free_port()} if ports else {})})
    path = os.path.join(str(workdir), "engine_jobs.json")
    with open(path, "w") as f:
        json.dump(jobs, f)
    return jobs, path


def run_engines_in_one_process(workdir, runs: Dict[str, List[str]], base=TINY):
    """run_engine(workdir / name, 1, *flags) for each of `runs` (name -> flags), one after another in one Python
    process: the entry point's main() each time, in a fresh copy of the launch environment (each run starts and
    tears down its own process group and seeds every RNG anew), so the start-up (torch, megatron-core: seconds)
    is paid once. Returns (name -> metrics lines, the completed process, whose output is every run's)."""
    jobs, path = _engine_jobs(workdir, runs, base)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--main", path], capture_output=True, text=True,
                          cwd=str(workdir), env=env, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"engine runs failed ({proc.returncode}): {list(runs)}\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return {name: [json.loads(x) for x in open(job["argv"][-1])] for name, job in zip(runs, jobs)}, proc


def run_engines_in_one_launch(workdir, nproc: int, runs: Dict[str, List[str]], base=TINY):
    """run_engines_in_one_process for `nproc` workers of one gloo job: each worker runs every job in turn, each job
    with a rendezvous port of its own (its process groups are torn down before the next starts). Returns
    name -> metrics lines (rank 0's)."""
    jobs, path = _engine_jobs(workdir, runs, base, ports=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = _run_workers_directly(nproc, [sys.executable, os.path.abspath(__file__), "--main", path], str(workdir),
                                 env, 900)
    if proc.returncode != 0:
        raise AssertionError(f"engine runs failed ({proc.returncode}): {list(runs)}\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return {name: [json.loads(x) for x in open(job["argv"][-1])] for name, job in zip(runs, jobs)}


def run_counting_forwards(workdir, *args: str, base=TINY):
    """Train on one process as run_engine does, but with step metrics deferred as on a GPU; returns (metrics lines,
    {"layer N" / "core_attention N": forward calls in training mode}), N the global layer number from 1. Evaluation runs in eval mode and
    is not counted, so without recomputation each count is iterations x micro batches."""
    return run_counting_forwards_together(workdir, {"run": list(args)}, base=base)["run"]


def run_counting_forwards_together(workdir, runs: Dict[str, List[str]], base=TINY) -> Dict[str, tuple]:
    """run_counting_forwards for each of `runs` (name -> flags), one after another in one process (each Trainer
    built once the previous one's process groups are torn down, as every new one seeds all RNGs anew): a Python
    start-up with torch and megatron-core (seconds) once; returns name -> (metrics lines, forward calls)."""
    os.makedirs(workdir, exist_ok=True)
    jobs = []
    for name, args in runs.items():
        metrics, counts = (os.path.join(str(workdir), f"{name}.{kind}") for kind in ("metrics.jsonl", "calls.json"))
        for path in (metrics, counts):
            if os.path.exists(path):
                os.remove(path)
        jobs.append({"argv": [*base, *args, "--metrics-file", metrics], "counts": counts})
    with open(os.path.join(str(workdir), "jobs.json"), "w") as f:
        json.dump(jobs, f)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--count-forwards",
                           os.path.join(str(workdir), "jobs.json")], capture_output=True, text=True, cwd=str(workdir),
                          env=env, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"counting runs failed ({proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    out = {}
    for name, job in zip(runs, jobs):
        with open(job["argv"][-1]) as f, open(job["counts"]) as g:
            out[name] = [json.loads(x) for x in f], json.load(g)
    return out


def _count_forwards_main(out: str, argv: List[str]) -> None:
    """One run of run_counting_forwards_together: the engine's Trainer, with forward hooks that count calls, and
    its step metrics deferred as on a GPU (a step's metrics read once the next step is queued).

    Hooks observe the real model; nothing in the training step is replaced."""
    import torch.distributed as dist
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_patch.config import parse_args
    from megatron_patch.parallel import destroy
    from megatron_patch.training.loop import Trainer

    counts = collections.Counter()

    def counter(key):
        def hook(module, inputs, output):
            if module.training:
                counts[key] += 1
        return hook

    try:
        trainer = Trainer(parse_args(argv))
        trainer.defer_step_metrics = True  # as on a GPU: each step's metrics read once the next step is queued
        for chunk in trainer.model:
            for m in chunk.modules():
                if isinstance(m, TransformerLayer):
                    m.register_forward_hook(counter(f"layer {m.layer_number}"))
                    m.self_attention.core_attention.register_forward_hook(counter(f"core_attention {m.layer_number}"))
        trainer.train()
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(counts, f)
    finally:
        destroy()


def rewind_validation(checkpoint) -> None:
    """Set the validation position stored in `checkpoint` (an iter_N directory) back to the first sample, so a
    --skip-train load evaluates the batches the saving run evaluated first (checkpoint.json is not in its own
    inventory: the checkpoint stays complete)."""
    manifest = os.path.join(str(checkpoint), "checkpoint.json")
    with open(manifest) as f:
        stored = json.load(f)
    with open(manifest, "w") as f:
        json.dump(dict(stored, consumed_valid_samples=0), f)


def full_weights(checkpoint: str) -> Dict[str, torch.Tensor]:
    """Model tensors of a dist_checkpointing (torch_dist) checkpoint, unsharded, keyed by global name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = checkpoint.rstrip("/") + ".pt"
    if not os.path.exists(out):
        dcp_to_torch_save(checkpoint, out)
    state = torch.load(out, weights_only=False)
    if json.load(open(os.path.join(checkpoint, "checkpoint.json")))["format"] != "fsdp_dtensor":
        return {k: v for k, v in state.items() if torch.is_tensor(v) and not k.startswith("optimizer.")}
    # ZeRO-2 (torch DCP of DTensors): "model.decoder.layers.<global i>.<name>" -> stacked "decoder.layers.<name>"
    import re

    flat, layers = {}, {}
    model = state["model"] if isinstance(state.get("model"), dict) else \
        {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    for half in [k for k in model if k.endswith("linear_fc1.weight_w") or k.endswith("linear_fc1.bias_w")]:
        model[half[:-2]] = torch.cat([model.pop(half), model.pop(half[:-1] + "v")])  # SwiGLU stored split: [gate; up]
    for k, v in model.items():
        if not torch.is_tensor(v):
            continue
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", k)
        if m:
            # dist_checkpointing names the local spec's norms as Transformer Engine's fused ones
            name = re.sub(r"^input_layernorm\.(\w+)$", r"self_attention.linear_qkv.layer_norm_\1", m.group(2))
            name = re.sub(r"^pre_mlp_layernorm\.(\w+)$", r"mlp.linear_fc1.layer_norm_\1", name)
            layers.setdefault(name, {})[int(m.group(1))] = v
        else:
            flat[k] = v
    for name, per_layer in layers.items():
        flat[f"decoder.layers.{name}"] = torch.stack([per_layer[i] for i in sorted(per_layer)])
    # With PP the last stage holds a copy of a tied embedding; it must have stayed equal to it.
    out, emb = flat.get("output_layer.weight"), flat.get("embedding.word_embeddings.weight")
    if out is not None and emb is not None and torch.allclose(out, emb, rtol=0, atol=1e-6):
        del flat["output_layer.weight"]
    return flat


if __name__ == "__main__":  # engine_utils.py --count-forwards JOBS.json (run_counting_forwards_together)
    # or --main JOBS.json (run_engines_in_one_process)
    sys.path.insert(0, ROOT)  # the engine of this tree, as pretrain_megatron_gpt.py would import it
    launch_env = dict(os.environ)
    with open(sys.argv[2]) as f:
        for job in json.load(f):
            os.environ.clear()  # the environment of a fresh process (initialize() records its rank and port there)
            os.environ.update(launch_env)
            if "port" in job:  # run_engines_in_one_launch: every job its own rendezvous
                os.environ["MASTER_PORT"] = str(job["port"])
            if sys.argv[1] == "--count-forwards":
                _count_forwards_main(job["counts"], job["argv"])
                continue
            from megatron_patch.cli.pretrain import main

            os.chdir(job["cwd"])
            status = main(job["argv"], model="gpt")
            if status:
                sys.exit(status)


def assert_trains_like(reference, lines: List[dict], weights: Dict[str, torch.Tensor]) -> None:
    """`reference`: (metrics lines, weights) of the single-process run. Same losses and gradient norm at each of the
    5 steps (1e-5 relative) and same weights after them."""
    ref_lines, ref_weights = reference
    losses, ref_losses = train_losses(lines), train_losses(ref_lines)
    assert len(losses) == len(ref_losses) == 5
    assert losses[-1] < losses[0]  # it learns
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    norms, ref_norms = per_iteration(lines, "grad_norm"), per_iteration(ref_lines, "grad_norm")
    assert all(n > 0 for n in ref_norms)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert set(weights) == set(ref_weights)
    for k, w in ref_weights.items():
        torch.testing.assert_close(weights[k], w, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
