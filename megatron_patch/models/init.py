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


@torch.no_grad()
def layout_invariant_init(module, seed: int, std: float, gated_linear_unit: bool) -> None:
    """Re-initialize `module` (one unwrapped model chunk) in place."""
    for name, p in module.named_parameters():
        gname = global_name(name, module)
        shape = global_shape(p, gname)
        g = _generator(gname, seed)
        if gname.endswith(("layer_norm_weight", "norm.weight")):
            full = torch.ones(shape)
        elif gname.endswith("bias") or gname.endswith("layer_norm_bias"):
            full = torch.zeros(shape)
        else:
            full = torch.randn(shape, generator=g) * std
        p.copy_(local_shard(full, p, gname, gated_linear_unit).to(device=p.device, dtype=p.dtype))
