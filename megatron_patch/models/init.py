"""Layout-invariant initialization (`--init-layout-invariant`): every parameter is drawn in full from a
generator seeded by its *global* name and then cut to this rank's tensor-parallel slice, so TP1 and
TP2xPP2 (any layout) start from exactly the same model. The parallel tests compare layouts this way."""
from __future__ import annotations

import hashlib
import re

import torch
from megatron.core import parallel_state as mpu


def _global_name(name: str, module) -> str:
    m = re.search(r"decoder\.layers\.(\d+)\.", name)
    if m:
        layer = module.decoder.layers[int(m.group(1))]
        name = name.replace(m.group(0), f"decoder.layers.{layer.layer_number - 1}.")
    if name == "output_layer.weight" and getattr(module, "share_embeddings_and_output_weights", False):
        name = "embedding.word_embeddings.weight"
    return name


def _generator(name: str, seed: int) -> torch.Generator:
    digest = int(hashlib.md5(f"{seed}:{name}".encode()).hexdigest()[:12], 16)
    return torch.Generator().manual_seed(digest)


@torch.no_grad()
def layout_invariant_init(module, seed: int, std: float, gated_linear_unit: bool) -> None:
    """Re-initialize `module` (one unwrapped model chunk) in place."""
    tp, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    for name, p in module.named_parameters():
        gname = _global_name(name, module)
        shape = list(p.shape)
        split = getattr(p, "tensor_model_parallel", False)
        dim = getattr(p, "partition_dim", -1)
        if split:
            shape[dim] *= tp
        g = _generator(gname, seed)
        if gname.endswith(("layer_norm_weight", "norm.weight")):
            full = torch.ones(shape)
        elif gname.endswith("bias") or gname.endswith("layer_norm_bias"):
            full = torch.zeros(shape)
        else:
            full = torch.randn(shape, generator=g) * std
        if split and tp > 1:
            if gated_linear_unit and "linear_fc1" in gname and dim == 0:
                # fc1 holds [gate; up]; each TP rank holds [gate_r; up_r].
                gate, up = full.chunk(2, dim=0)
                full = torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
            else:
                full = full.chunk(tp, dim=dim)[rank]
        p.copy_(full.to(device=p.device, dtype=p.dtype))
