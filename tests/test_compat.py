"""megatron_patch.compat: one canary per workaround (the upstream code it patches is still the code it was
written for), the version check, and a behavioural check per patch where that is cheap.

The CPU-backend and Megatron-FSDP patches change process-wide torch/megatron-core state, so they are
exercised in a fresh interpreter; the call-site helpers run in-process on small fakes.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
import torch

from megatron_patch import compat
from megatron_patch.compat import adam_state, checkpoint_writer, megatron_fsdp, registry, versions
from megatron_patch.compat import optimizer as compat_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- canaries

@pytest.mark.parametrize("name", sorted(compat.PATCHES))
def test_upstream_code_unchanged(name):
    patch = compat.PATCHES[name]
    current = patch.current_fingerprint()
    assert current == patch.fingerprint, (
        f"compat patch {name} ({patch.module}): the upstream code it patches changed: {', '.join(patch.upstream)} "
        f"(fingerprint {patch.fingerprint} recorded with {patch.tested}; installed: {versions.installed_versions()}, "
        f"now {current}). Re-read that upstream code, re-check the patch (still needed? still right?), then set "
        f'fingerprint="{current}" in {patch.module.replace(".", "/")}.py.')


def test_every_patch_is_described_and_global_patches_are_ordered():
    for p in compat.PATCHES.values():
        assert p.upstream and all(":" in u for u in p.upstream), p.name
        assert len(p.fingerprint) == 16 and int(p.fingerprint, 16) >= 0, p.name
        assert p.fixes and p.tested and callable(p.function) and p.function.patch is p
    ordered = {fn.__name__ for fn in compat.CPU_BACKEND + compat.MEGATRON_FSDP}
    assert len(ordered) == len(compat.CPU_BACKEND) + len(compat.MEGATRON_FSDP)
    assert {n for n, p in compat.PATCHES.items() if p.module.endswith(".cpu_backend")} <= ordered
    for fn in compat.CPU_BACKEND + compat.MEGATRON_FSDP:  # the docstring lists every applied patch
        assert fn.__name__ in compat.__doc__, fn.__name__


def test_fingerprint_is_sensitive_to_the_upstream_code():
    fp = registry.fingerprint(("torch/cuda/__init__.py:current_device",))
    assert fp == compat.PATCHES["cuda_current_device_is_zero"].fingerprint
    assert registry.fingerprint(("torch/cuda/__init__.py:synchronize",)) != fp
    assert registry.resolve("megatron/core/distributed/finalize_model_grads.py:_allreduce_embedding_grad").__name__ \
        == "_allreduce_embedding_grad"  # the module, not the function megatron.core.distributed re-exports


# ---------------------------------------------------------------- version check

@pytest.fixture
def fresh_check(monkeypatch):
    monkeypatch.setattr(versions, "_CHECKED", None)
    return monkeypatch


def test_untested_versions_warn_once_naming_them(fresh_check):
    fresh_check.setattr(versions, "installed_versions", lambda: {"megatron-core": "0.20.0", "torch": "2.12.1"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compat.check_versions() is False
        assert compat.check_versions() is False
    ours = [w for w in caught if issubclass(w.category, versions.UntestedVersionWarning)]
    assert len(ours) == 1
    text = str(ours[0].message)
    assert "megatron-core 0.19.2" in text and "torch 2.11.x" in text  # what was tested
    assert "megatron-core 0.20.0" in text and "torch 2.12.1" in text  # what is installed


def test_tested_versions_with_local_suffix_are_quiet(fresh_check):
    fresh_check.setattr(versions, "installed_versions", lambda: {"megatron-core": "0.19.2+1b5afd9", "torch": "2.11.0+cu130"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", versions.UntestedVersionWarning)
        assert compat.check_versions() is True


# ---------------------------------------------------------------- call-site helpers, in-process

def _adamw(*params, **kw):
    return torch.optim.AdamW([torch.nn.Parameter(p) for p in params], lr=0.1, **kw)


def test_torch_dist_write_results_stay_in_this_process(monkeypatch):
    """The torch_dist writer's results queue is one of this process: no Manager server spawned at the first save.
    (In process, milliseconds; every engine checkpoint test saves through it.)"""
    import multiprocessing
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    before = set(multiprocessing.active_children())
    checkpoint_writer.write_results_in_process()
    made = filesystem_async.get_write_results_queue()
    assert isinstance(made, queue.Queue) and set(multiprocessing.active_children()) == before
    checkpoint_writer.write_results_in_process()
    assert filesystem_async.get_write_results_queue() is made  # made once per process, kept


def test_fill_empty_adam_state():
    inner = _adamw(torch.ones(3), torch.ones(2))
    p0, p1 = inner.param_groups[0]["params"]
    inner.state[p0] = {"step": torch.tensor(4.0), "exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3)}
    adam_state.fill_empty_adam_state(types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=inner)]))
    assert inner.state[p0]["exp_avg"].sum() == 3  # existing state untouched
    assert inner.state[p1]["step"].item() == 4.0 and inner.state[p1]["step"].device.type == "cpu"
    assert inner.state[p1]["exp_avg"].shape == (2,) and inner.state[p1]["exp_avg_sq"].abs().sum() == 0


def test_restore_adam_step():
    inner = _adamw(torch.ones(2), torch.ones(2))
    for p in inner.param_groups[0]["params"]:
        inner.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}
    wrapper = types.SimpleNamespace(optimizer=inner)
    adam_state.restore_adam_step(wrapper, {"optimizer": {"param_groups": [{"step": 7}, {"step": 7}]}})
    assert [s["step"].item() for s in inner.state.values()] == [7.0, 7.0]
    adam_state.restore_adam_step(wrapper, {"optimizer": {"param_groups": [{"step": 3}, {"step": 5}]}})  # ambiguous
    assert [s["step"].item() for s in inner.state.values()] == [7.0, 7.0]


def test_restore_adam_step_of_each_chained_member():
    """MoE's ChainedOptimizer (dense, expert) loads {index: state}: each member takes its own step."""
    members = []
    for _ in range(2):
        inner = _adamw(torch.ones(2))
        inner.state[inner.param_groups[0]["params"][0]] = {"step": torch.tensor(1.0)}
        members.append(types.SimpleNamespace(optimizer=inner))
    chained = types.SimpleNamespace(chained_optimizers=members)
    adam_state.restore_adam_step(chained, {1: {"optimizer": {"param_groups": [{"step": 5}]}},
                                           0: {"optimizer": {"param_groups": [{"step": 4}]}}})
    assert [next(iter(m.optimizer.state.values()))["step"].item() for m in members] == [4.0, 5.0]


def test_steps_on_param_device():
    inner = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, device="meta"))], lr=0.1)
    (p,) = inner.param_groups[0]["params"]
    inner.state[p] = {"step": torch.tensor(2.0)}
    adam_state.steps_on_param_device(types.SimpleNamespace(optimizer=inner))
    assert inner.state[p]["step"].device.type == "cpu"  # not fused: torch keeps step on the CPU
    inner.param_groups[0]["fused"] = True
    adam_state.steps_on_param_device(types.SimpleNamespace(optimizer=inner))
    assert inner.state[p]["step"].device.type == "meta"


def test_replace_torch_optimizer_keeps_megatron_group_keys():
    from megatron_patch.accelerations.lamb import Lamb

    inner = _adamw(torch.ones(2))
    inner.param_groups[0].update(wd_mult=0.0, lr_mult=1.0)
    params = inner.param_groups[0]["params"]
    wrappers = [types.SimpleNamespace(optimizer=inner)]
    compat_optimizer.replace_torch_optimizer(types.SimpleNamespace(chained_optimizers=wrappers),
                                             lambda groups: Lamb(groups, lr=0.5, betas=(0.8, 0.9)))
    new = wrappers[0].optimizer
    assert isinstance(new, Lamb)
    group = new.param_groups[0]
    assert group["params"] == params and group["wd_mult"] == 0.0 and group["lr_mult"] == 1.0
    assert group["betas"] == (0.8, 0.9) and group["lr"] == 0.1  # Adam's defaults dropped; the group's lr kept
    assert "amsgrad" not in group and "fused" not in group


def test_use_fused_adam():
    inner = _adamw(torch.ones(2))
    compat_optimizer.use_fused_adam(types.SimpleNamespace(optimizer=inner))
    assert inner.param_groups[0]["fused"] is True and inner.param_groups[0]["foreach"] is False


def test_mesh_from_ranks_with_pipeline_stages():
    # world 8 = TP2 x PP2 x DP2 (megatron order tp-dp-pp): rank 5 is in stage 1, DP group [5, 7], TP group [4, 5].
    # megatron-core 0.19.2 reshapes arange(8) into (dp, tp) = (2, 2) and fails; this stage's mesh is:
    assert megatron_fsdp.mesh_from_ranks(5, [5, 7], [4, 5]).tolist() == [[4, 5], [6, 7]]
    assert megatron_fsdp.mesh_from_ranks(2, [0, 2], [2]).tolist() == [[0], [2]]


def test_megatron_fsdp_call_site_helpers():
    calls = []

    class Inner:
        def _replace_param_with_distributed_if_needed(self):
            calls.append("inner")

    class Outer:
        module = Inner()

    megatron_fsdp.use_distributed_params([Outer(), Outer()])
    assert calls == ["inner", "inner"]
    Inner._replace_param_with_raw_if_needed = lambda self: calls.append("raw")
    megatron_fsdp.use_raw_params([Outer()])
    assert calls == ["inner", "inner", "raw"]
    copied = []
    wrapper = types.SimpleNamespace(_copy_main_params_to_model_params=lambda: copied.append(1))
    megatron_fsdp.copy_main_to_model_params(types.SimpleNamespace(chained_optimizers=[wrapper, wrapper]))
    assert copied == [1, 1]
    state = {"model": {"w": torch.ones(2)}, "step": 3}
    assert megatron_fsdp.prepare_uneven_dtensor_state(state) is state  # no DTensor: nothing to annotate


# ---------------------------------------------------------------- global patches, in a fresh interpreter

SCRIPT = r'''
import logging, os, sys, warnings
import torch
import torch.distributed as dist

from megatron_patch import compat
from megatron_patch.compat import registry

assert not torch.cuda.is_available()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    compat.apply_cpu_backend()
    compat.apply_cpu_backend()  # idempotent
    compat.apply_megatron_fsdp_fixes()
    compat.apply_megatron_fsdp_fixes()
assert sum(issubclass(w.category, compat.UntestedVersionWarning) for w in caught) <= 1
assert compat.APPLIED == [f.__name__ for f in compat.CPU_BACKEND + compat.MEGATRON_FSDP], compat.APPLIED
assert compat.cpu_backend_enabled()

# the canaries still see upstream's code after patching
for name, p in compat.PATCHES.items():
    assert p.current_fingerprint() == p.fingerprint, name

# 1 current_device, 11 device arguments
assert torch.cuda.current_device() == 0
assert torch.zeros(2, device="cuda").device.type == "cpu"
assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
assert torch.ones(2).to(torch.device("cuda", 0)).device.type == "cpu"
assert torch.ones(2).to("cuda:0", torch.float64).dtype == torch.float64
# 2 synchronize, 6 streams/events, 7 Tensor.cuda, 8 record_stream
torch.cuda.synchronize()
s = torch.cuda.Stream()
torch.cuda.current_stream().wait_stream(s)
e = torch.cuda.Event(enable_timing=True); e.record(); e.synchronize()
with torch.cuda.stream(s):
    pass
t = torch.ones(2)
assert t.cuda() is t
t.record_stream(torch.cuda.current_stream())
# 9 Tensor.type
assert torch.ones(1).type() == "torch.cuda.FloatTensor"
assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
assert torch.ones(1).type(torch.float64).dtype == torch.float64
# 3 CUDA RNG API, 4 megatron-core's tracker, 5 its warning filter
torch.cuda.manual_seed(3)
assert torch.equal(torch.cuda.get_rng_state(), torch.get_rng_state())
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("megatron.core.tensor_parallel.random").addHandler(Keep())
torch.manual_seed(0)
tracker = CudaRNGStatesTracker()
tracker.add("tp", 42)
with tracker.fork("tp"):
    inside = torch.rand(3)
after = torch.rand(3)
torch.manual_seed(42); assert torch.equal(inside, torch.rand(3))  # the fork ran on its own stream
torch.manual_seed(0); assert torch.equal(after, torch.rand(3))    # and gave the outer stream back
assert records == [], records

# 10 DeviceMesh.from_group, and the FSDP mesh fix in a world of one
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
# precise_grad_norm_on_cpu: the gradient norm in float64: torch.norm is off by ~7e-4 here on the CPU (2M equal fp32 values)
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
g = torch.full((2_000_000,), 1e-3)
assert abs(get_grad_norm_fp32([g, torch.ones(3)], grad_stats_parallel_group=None) / (2.0 + 3.0) ** 0.5 - 1) < 1e-6
from torch.distributed.device_mesh import DeviceMesh
assert DeviceMesh.from_group(dist.group.WORLD, "cuda").device_type == "cpu"
import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter
assert adapter._get_dp_tp_mesh(dist.group.WORLD, None).tolist() == [[0]]
# the world-group check is skipped whatever the caller asks for
import megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer as pgb
seen = {}
upstream = registry.original(pgb, "make_fsdp_dtensor")
cell = [c for c in pgb.make_fsdp_dtensor.__closure__ if c.cell_contents is upstream][0]
cell.cell_contents = lambda *a, **k: seen.update(k)
pgb.make_fsdp_dtensor(None, None, None, run_check=True)
assert seen["run_check"] is False
dist.destroy_process_group()
print("OK")
'''


def test_global_patches_in_a_fresh_process(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), str(tmp_path / "store")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-3000:] + proc.stderr[-5000:]


def test_set_param_group_lr_range_of_each_chained_member():
    """Every group of every member takes the range (megatron-core pairs saved groups with these by it)."""
    members = [types.SimpleNamespace(param_groups=[{"max_lr": 1e-4, "min_lr": 0.0, "wd_mult": w} for w in (0.0, 1.0)])
               for _ in range(2)]
    chained = types.SimpleNamespace(param_groups=[g for m in members for g in m.param_groups])
    compat_optimizer.set_param_group_lr_range(chained, 2e-4, 1e-5)
    assert [(g["max_lr"], g["min_lr"], g["wd_mult"]) for m in members for g in m.param_groups] == \
        [(2e-4, 1e-5, 0.0), (2e-4, 1e-5, 1.0)] * 2


def test_moe_tracker_tensors_exist_before_capture():
    """The tracker's tensors are created before the first step, marked static for CUDA graphs, and record() and
    clear() keep adding into that same storage (a tensor created inside a CUDA graph would be its output)."""
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker

    from megatron_patch.compat.moe import tracker_tensors_before_capture

    tracker, counts = MoEMetricsTracker(), torch.zeros(4, 3, dtype=torch.int64)
    tracker_tensors_before_capture(tracker, ["load_balancing_loss", "z_loss"], 4, "cpu", extra=[counts])
    values = tracker._metrics["load_balancing_loss"].values
    assert values.shape == (4,) and tracker._metrics["z_loss"].values.shape == (4,)
    for t in (values, counts):
        assert getattr(t, "_dynamo_static_input_type", None) is not None
    tracker.record("load_balancing_loss", torch.tensor(2.5), layer_number=2, num_layers=4)
    tracker.clear()
    tracker.record("load_balancing_loss", torch.tensor(1.5), layer_number=3, num_layers=4)
    assert tracker._metrics["load_balancing_loss"].values is values
    assert values.tolist() == [0.0, 0.0, 1.5, 0.0]
