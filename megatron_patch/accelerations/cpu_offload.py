"""`--cpu-offload` without FSDP2: the optimizer state and the optimizer step live on the CPU.

`CPUOffloadOptimizer` holds an fp32 master copy of each parameter in host memory (pinned when the
parameters are on a GPU) and an inner optimizer (torch AdamW, LAMB, ...) over those copies, so the
Adam moments are allocated on the CPU too. Each step copies the gradients to the CPU, steps there and
copies the updated weights back into the model's parameters.

It is a torch.optim.Optimizer over the model's parameters: GradScaler unscales the model's gradients,
LR schedulers set `param_groups[i]["lr"]` (copied to the inner optimizer at every step), and
`state` / `state_dict()` are keyed by the model's parameters in torch's usual format (tensors on the
CPU). `offloaded(cls)` makes a subclass bound to one inner class, so it can be handed to
ZeroRedundancyOptimizer as its `optimizer_class`: `--zero-1-memory-optimization --cpu-offload` then
offloads just this rank's shard.

The master copies are the weights the optimizer updates. After changing the model's weights from outside
(loading a checkpoint), call `load_state_dict` (which refreshes them) or `sync_from_params()`.
With ZeRO-2/3, offloading is FSDP2's CPUOffloadPolicy instead (data_parallel.py), not this class.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Dict, Iterator, Type

import torch


class _StateByModelParam(MutableMapping):
    """The inner optimizer's `state`, keyed by master copies, stored in the outer optimizer's `state`
    under the model parameter each master copies."""

    def __init__(self, outer: torch.optim.Optimizer, param_of: Dict[torch.Tensor, torch.Tensor]) -> None:
        # `outer.state` is looked up each time: Optimizer.load_state_dict replaces the dict.
        self._outer, self._param_of = outer, param_of

    def __getitem__(self, master):
        return self._outer.state[self._param_of[master]]  # defaultdict(dict): created on first use

    def __setitem__(self, master, value) -> None:
        self._outer.state[self._param_of[master]] = value

    def __delitem__(self, master) -> None:
        del self._outer.state[self._param_of[master]]

    def __iter__(self) -> Iterator:
        masters = {p: m for m, p in self._param_of.items()}
        return (masters[p] for p in self._outer.state if p in masters)

    def __len__(self) -> int:
        return sum(1 for _ in self)


# Per-group switches that choose a device kernel: the inner optimizer on the CPU keeps its own.
_DEVICE_KEYS = ("params", "fused", "foreach", "capturable")


class CPUOffloadOptimizer(torch.optim.Optimizer):
    inner_class: Type[torch.optim.Optimizer] = torch.optim.AdamW
    inner_kwargs: Dict[str, Any] = {"foreach": True}

    def __init__(self, params, **defaults) -> None:
        super().__init__(params, defaults)
        from torch.distributed.tensor import DTensor

        self.masters: Dict[torch.Tensor, torch.Tensor] = {}  # model parameter -> fp32 CPU copy
        inner_groups = []
        for group in self.param_groups:
            copies = []
            for p in group["params"]:
                if isinstance(p, DTensor):
                    raise TypeError("CPUOffloadOptimizer takes plain parameters; FSDP2 shards offload through "
                                    "CPUOffloadPolicy")
                m = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=p.is_cuda)
                m.copy_(p.detach())
                self.masters[p] = m
                copies.append(m)
            inner_groups.append({**{k: v for k, v in group.items() if k not in _DEVICE_KEYS}, "params": copies})
        inner_defaults = {k: v for k, v in defaults.items() if k not in _DEVICE_KEYS}
        self.inner = self.inner_class(inner_groups, **{**inner_defaults, **self.inner_kwargs})
        self.inner.state = _StateByModelParam(self, {m: p for p, m in self.masters.items()})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = []
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            for key, value in group.items():  # lr/weight decay set by schedulers on the outer groups
                if key not in _DEVICE_KEYS:
                    inner[key] = value
            for p in group["params"]:
                m = self.masters[p]
                m.grad = None if p.grad is None else p.grad.detach().to("cpu", torch.float32, non_blocking=True)
                if p.grad is not None:
                    stepped.append(p)
        if any(p.is_cuda for p in stepped):
            torch.cuda.synchronize()  # the non-blocking device-to-host gradient copies have landed
        self._state_to_cpu()
        self.inner.step()
        for p in stepped:
            p.copy_(self.masters[p], non_blocking=True)
            self.masters[p].grad = None
        return loss

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # moves the state to each parameter's device ...
        self._state_to_cpu()  # ... and this brings it back to the host
        self.sync_from_params()

    def sync_from_params(self) -> None:
        """Refresh the fp32 master copies from the model's parameters (after the weights were loaded)."""
        with torch.no_grad():
            for p, m in self.masters.items():
                m.copy_(p.detach())

    def _state_to_cpu(self) -> None:
        # ZeroRedundancyOptimizer.load_state_dict puts loaded state on the parameter's device.
        for state in self.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.device.type != "cpu":
                    state[key] = value.to("cpu")


def offloaded(optimizer_class: Type[torch.optim.Optimizer], **inner_kwargs) -> Type[CPUOffloadOptimizer]:
    """A CPUOffloadOptimizer subclass stepping with `optimizer_class(master_groups, **defaults, **inner_kwargs)`."""
    name = f"CPUOffload{optimizer_class.__name__}"
    return type(name, (CPUOffloadOptimizer,), {"inner_class": optimizer_class, "inner_kwargs": dict(inner_kwargs),
                                               "__module__": __name__, "__qualname__": name})
