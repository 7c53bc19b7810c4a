"""Repairs of torch Adam/AdamW state around megatron-core's distributed optimizer checkpoints.

Called by the checkpointing code (not applied globally): `fill_empty_adam_state` before building the
optimizer's sharded state dict, `restore_adam_step` after loading a ZeRO-1 checkpoint, `steps_on_param_device`
after loading a ZeRO-2 one.
"""
from __future__ import annotations

import contextlib

import torch

from .registry import register


def _inner_optimizers(optimizer):
    for w in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(w, "optimizer", None)
        if inner is not None:
            yield inner


@register(upstream=("torch/optim/adam.py:Adam._init_group",
                    "megatron/core/optimizer/distrib_optimizer.py:DistributedOptimizer._get_main_param_and_optimizer_states",
                    "megatron/core/optimizer/distrib_optimizer.py:DistributedOptimizer.sharded_param_state_fsdp_dtensor",
                    "megatron/core/optimizer/distrib_optimizer.py:DistributedOptimizer._init_optimizer_states_with_dummy_values"),
          fixes="torch creates Adam state lazily at the first step, but megatron-core's distributed optimizer reads it "
                "(step included) to build the dict it loads into; and under Megatron-FSDP a parameter whose shard is "
                "empty on this rank never gets state (the dummy init skips it), so ranks describe different checkpoint "
                "keys and the collective metadata exchange hangs: give every parameter zero state where it has none",
          fingerprint="b43578339c43bf70")
def fill_empty_adam_state(optimizer) -> None:
    """Give every parameter of torch Adam/AdamW zero state (step, exp_avg, exp_avg_sq) where it has none yet;
    `step` copies an existing step when there is one, and lives where torch keeps it (the parameter's device
    for fused/capturable groups, the CPU otherwise)."""
    for inner in _inner_optimizers(optimizer):
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        steps = [st["step"] for st in inner.state.values() if "step" in st]
        for group in inner.param_groups:
            on_device = group.get("fused") or group.get("capturable")  # such steps live with the params
            for p in group["params"]:
                if not inner.state[p]:
                    step = steps[0].clone() if steps else torch.zeros((), dtype=torch.float32)
                    inner.state[p] = {"step": step.to(p.device if on_device else "cpu"),
                                      "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


@register(upstream=("megatron/core/optimizer/distrib_optimizer.py:DistributedOptimizer.load_state_dict",
                    "megatron/core/optimizer/distrib_optimizer.py:DistributedOptimizer.sharded_param_state_dp_reshardable",
                    "megatron/core/optimizer/distrib_optimizer.py:DistributedOptimizer._set_main_param_and_optimizer_states"),
          fixes="the distributed optimizer sets torch Adam's per-parameter `step` correctly from the param groups, then "
                "overwrites it from the parameter-state shards, which do not carry it (they hold "
                "fill_empty_adam_state's placeholder): put the param groups' step back so bias correction resumes exactly",
          fingerprint="29fdda1b48cabcb8")
def restore_adam_step(optimizer, loaded_optimizer_state) -> None:
    """Set every tensor `step` of the inner torch optimizers to the single step recorded in the loaded
    state's param groups (`loaded_optimizer_state["optimizer"]["param_groups"][i]["step"]`); no-op when
    there is no such single step. A ChainedOptimizer of several (MoE: dense and expert parameters) loads a
    dict {index: state} and each member takes the step of its own state."""
    members = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(members) > 1 and isinstance(loaded_optimizer_state, dict):
        for member, (_, state) in zip(members, sorted(loaded_optimizer_state.items())):
            restore_adam_step(member, state)
        return
    opt = loaded_optimizer_state.get("optimizer") if isinstance(loaded_optimizer_state, dict) else None
    groups = (opt or {}).get("param_groups") if isinstance(opt, dict) else None
    steps = {g["step"] for g in groups or [] if "step" in g}
    if len(steps) != 1:
        return
    step = float(steps.pop())
    for inner in _inner_optimizers(optimizer):
        for state in getattr(inner, "state", {}).values():
            if "step" in state and torch.is_tensor(state["step"]):
                state["step"] = torch.tensor(step, dtype=state["step"].dtype, device=state["step"].device)


@register(upstream="torch/optim/optimizer.py:Optimizer._process_value_according_to_param_policy",
          fixes="torch's fused AdamW keeps `step` on the parameter's device, but load_state_dict leaves it on the CPU "
                "when the *loaded* param groups do not say `fused` (megatron-core's state dicts don't): move it back",
          fingerprint="41b1e22f58053073")
def steps_on_param_device(optimizer) -> None:
    """Move `step` onto its parameter's device in every fused or capturable param group."""
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            if not (group.get("fused") or group.get("capturable")):
                continue
            for p in group["params"]:
                st = inner.state.get(p, {})
                if torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].to(p.device)


@register(upstream=("megatron/core/optimizer/distrib_optimizer.py:DistributedOptimizer._set_main_param_and_optimizer_states",
                    "megatron/core/optimizer/distrib_optimizer.py:DistributedOptimizer.load_parameter_state_from_fully_reshardable"),
          fixes="loading a fully_reshardable ZeRO-1 checkpoint copies every tensor of a parameter's optimizer state from "
                "the checkpoint's per-parameter tensors, which hold the main weight and the moments but not torch "
                "Adam's tensor `step` (KeyError: 'step'): while loading, a key the checkpoint lacks reads as None, "
                "which megatron-core skips; restore_adam_step then sets `step` from the param groups",
          fingerprint="086e797df8da7a7b")
@contextlib.contextmanager
def steps_kept_out(optimizer, active: bool = True):
    """While the block runs, each distributed optimizer of `optimizer` sets a parameter's state only from the tensors
    the checkpoint has (a missing one, `step`, is left as it is). A no-op when not `active`."""
    patched = []
    if active:
        for member in getattr(optimizer, "chained_optimizers", [optimizer]):
            original = getattr(member, "_set_main_param_and_optimizer_states", None)
            if original is None:
                continue

            def set_states(model_param, tensors, _original=original):
                return _original(model_param, _NoneForMissing(tensors))

            member._set_main_param_and_optimizer_states = set_states  # this instance only, for this block
            patched.append(member)
    try:
        yield
    finally:
        for member in patched:
            del member._set_main_param_and_optimizer_states


class _NoneForMissing(dict):
    def __missing__(self, key):
        return None
