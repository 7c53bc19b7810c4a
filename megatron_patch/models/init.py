"""Layout-invariant initialization (`--init-layout-invariant`): every parameter is drawn in full from a
generator seeded by its *global* name and then cut to this rank's tensor-parallel slice, so TP1 and
TP2xPP2 (any layout) start from exactly the same model. The parallel tests compare layouts this way."""
from __future__ import annotations

import hashlib

import torch

from .partition import global_name, global_shape, local_shard


def _generator(name: str, seed: int) -> torch.Generator:
    digest = int(hashlib.md5(f"{seed}:{name}".encode()).hexdigest()[:12], 16)
    return torch.Generator().manual_seed(digest)


def initial_tensor(gname: str, shape, seed: int, std: float) -> torch.Tensor:
    """The full initial value of the parameter with global name `gname`: norm weights 1, biases 0, everything
    else N(0, std) from a generator seeded by (seed, gname)."""
    if gname.endswith(("layer_norm_weight", "norm.weight")):
        return torch.ones(shape)
    if gname.endswith("bias") or gname.endswith("layer_norm_bias"):
        return torch.zeros(shape)
    return torch.randn(shape, generator=_generator(gname, seed)) * std


@torch.no_grad()
def layout_invariant_init(module, seed: int, std: float, gated_linear_unit: bool) -> None:
    """Re-initialize `module` (one unwrapped model chunk) in place."""
    for name, p in module.named_parameters():
        gname = global_name(name, module)
        full = initial_tensor(gname, global_shape(p, gname), seed, std)
        p.copy_(local_shard(full, p, gname, gated_linear_unit).to(device=p.device, dtype=p.dtype))
