"""Shared by the fused-loss tests (test_linear_cross_entropy.py, test_triton_cross_entropy.py): the relative error,
the GPT model at TP2 with a fused loss against the unfused one, and a pair of engine runs with and without it."""
from __future__ import annotations

import importlib
import json
import os
from typing import Callable, Dict

import pytest
import torch
import torch.multiprocessing as mp

from engine_utils import free_port, per_iteration, run_engine
from megatron_patch.config import parse_args

# A tiny GPT at TP2 with 100 tokens: with --make-vocab-size-divisible-by 64, 128 rows (64 per rank), 28 of them padding.
TP2_BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "8", "--vocab-size", "100", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--tensor-model-parallel-size", "2"]


def rel(a, b) -> float:
    """Largest difference relative to the largest magnitude of the reference."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def tp2_results(tmp_path, body: Callable, flags, **env: str) -> dict:
    """Run `body(rank, tp_group)` on two gloo processes initialized with TP2_BASE + `flags` (and `env` set in each
    process before that); returns rank 0's result (a JSON-able dict). `body` must be a module-level function."""
    out = str(tmp_path / "tp.json")
    mp.start_processes(_tp2_worker, args=(free_port(), out, body, list(flags), env), nprocs=2, start_method="spawn")
    with open(out) as f:
        return json.load(f)


# The TP2 checks of both fused losses (each test module's `_tp_body`), run in one spawn of two processes on first use
# (CI time: the processes' start-up once); the Triton one in Triton's interpreter, which the linear loss never calls
TP2_BODIES = {"linear": "test_linear_cross_entropy", "triton": "test_triton_cross_entropy"}
_tp2_bodies_results: Dict[str, dict] = {}


def tp2_results_of(name: str, tmp_path_factory) -> dict:
    """Rank 0's result of TP2_BODIES[name]._tp_body at TP2 (see tp2_results), from the spawn that runs them all."""
    if not _tp2_bodies_results:
        _tp2_bodies_results.update(tp2_results(tmp_path_factory.mktemp("tp2_fused_losses"), _all_tp2_bodies, [],
                                               TRITON_INTERPRET="1"))
    return _tp2_bodies_results[name]


def _all_tp2_bodies(rank: int, group) -> dict:
    return {name: importlib.import_module(module)._tp_body(rank, group) for name, module in TP2_BODIES.items()}


def _tp2_worker(rank: int, port: int, out: str, body: Callable, flags, env: Dict[str, str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", **env)
    torch.set_num_threads(1)
    from megatron.core import parallel_state as mpu

    from megatron_patch.parallel import destroy, initialize

    initialize(parse_args(TP2_BASE + flags))
    try:
        results = body(rank, mpu.get_tensor_model_parallel_group())
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        destroy()


def model_check(base, fused_flags, module: str, function: str, switch: str) -> dict:
    """GPTModelWithVocab (inside initialized process groups) with `fused_flags`: the loss and every parameter's
    gradient with the model's `switch` attribute on and off (same weights), how often `module.function` (the fused
    path) ran with labels and without them, and the logits' shape without labels."""
    from megatron_patch.models import build_gpt_model

    mod = importlib.import_module(module)
    real, calls = getattr(mod, function), []

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    setattr(mod, function, counting)
    cfg = parse_args(base + fused_flags + ["--make-vocab-size-divisible-by", "64"])  # 100 tokens, 128 rows
    cfg = cfg.validate(2)
    model = build_gpt_model(cfg, 100)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 100, (2, 8), generator=g)
    labels = torch.randint(0, 100, (2, 8), generator=g)
    labels[0, 0] = 99
    positions = torch.arange(8).expand(2, 8)
    weight = torch.rand(2, 8, generator=g)
    out = {}
    for fused in (True, False):
        setattr(model, switch, fused)
        model.zero_grad()
        loss = model(tokens, positions, None, labels=labels)
        (loss * weight).sum().backward()
        out[fused] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    fused_calls = len(calls)
    setattr(model, switch, True)
    with torch.no_grad():
        logits = model(tokens, positions, None)
    setattr(mod, function, real)
    return {"calls_with_labels": fused_calls, "calls_without_labels": len(calls) - fused_calls,
            "logits_shape": list(logits.shape), "loss": rel(out[True][0], out[False][0]),
            "loss_shape": list(out[True][0].shape),
            "grads": {n: rel(out[True][1][n], out[False][1][n]) for n in out[False][1]}}


def engine_pair(tmp_path, nproc, *args, fused_flags, fused_log, tol, iterations=5):
    """Two engine runs (vocabulary 100, so padded rows exist), without and with `fused_flags`: the fused one logs
    `fused_log`, and its per-iteration losses, grad norms and validation losses are the plain run's within `tol`."""
    runs = {}
    for name, extra in (("plain", []), ("fused", fused_flags)):
        lines, proc = run_engine(tmp_path / name, nproc, "--vocab-size", "100", *args, *extra)
        runs[name] = {"loss": per_iteration(lines, "loss"), "grad_norm": per_iteration(lines, "grad_norm"),
                      "valid": [x["valid_loss"] for x in lines if "valid_loss" in x], "log": proc.stdout}
    assert fused_log in runs["fused"]["log"] and fused_log not in runs["plain"]["log"]
    plain, fused = runs["plain"], runs["fused"]
    assert len(plain["loss"]) == iterations and plain["valid"]
    for key, rel_tol in tol.items():
        assert fused[key] == pytest.approx(plain[key], rel=rel_tol), key
    return runs
