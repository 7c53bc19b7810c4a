"""LoRA on megatron-core's tensor-parallel linears (`--lora-rank`, `--lora-alpha`, `--lora-dropout`,
`--lora-target`): y = W x + (alpha / rank) * B A dropout(x), with W (and every other base parameter) frozen.

The adapters are split the way their layer is, so that they are tensor-parallel without extra weights:

  column-parallel (linear_qkv, linear_fc1; W [out/tp, in]): A [rank, in] is whole on every rank, B [out/tp, rank]
      is cut like W's rows (SwiGLU's fc1 as [gate_r; up_r], like W). A's input is the layer's (gathered over the
      sequence with sequence parallelism, its gradient split back); A's output goes through megatron-core's
      copy-to-TP region, whose backward sums the ranks' gradients, so A's gradient is whole on every rank.
  row-parallel (linear_proj, linear_fc2; W [out, in/tp]): A [rank, in/tp] is cut like W's columns, B [out, rank]
      is whole; A's partial outputs are summed over TP (reduce-scattered over the sequence with sequence
      parallelism, where B's gradient is then summed over TP by megatron-core, as for the norms).

B starts at 0 (the model starts as the base model) and A at PEFT's kaiming-uniform bound 1/sqrt(in), drawn whole
from a generator seeded by its global name and cut to the rank's slice: every TP/PP layout starts alike.
Frozen parameters get no gradient buffer in megatron-core's DDP and no optimizer state. The adapters' global
names (`...linear_qkv.lora_A`, `.lora_B`) are in the checkpoint beside the base weights.

Hugging Face's separate q/k/v and gate/up projections are one fused layer here: `--lora-target q_proj k_proj
v_proj` means linear_qkv (all three or none), `gate_proj up_proj` linear_fc1; the PEFT export splits B's rows per
Hugging Face module and gives each of them the shared A (conversion/lora_export.py). Routed experts are not adapted.
"""
from __future__ import annotations

import hashlib
import math
from typing import Dict, List

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, copy_to_tensor_model_parallel_region,
                                           gather_from_sequence_parallel_region,
                                           reduce_from_tensor_model_parallel_region,
                                           reduce_scatter_to_sequence_parallel_region)

from megatron_patch.config.lora_targets import resolve_targets

from .partition import global_name, local_shard

def _generator(name: str, seed: int) -> torch.Generator:
    digest = int(hashlib.md5(f"lora:{seed}:{name}".encode()).hexdigest()[:12], 16)
    return torch.Generator().manual_seed(digest)


class _LoRA:
    """The adapter's state and init, shared by both kinds of layer (mixed into the megatron-core class)."""

    lora_scale: float
    lora_dropout: float

    def _lora_params(self, rank: int) -> None:
        """A [rank, in] and B [out, rank] of this rank's weight slice [out, in], zero (apply_lora initialises A)."""
        out, inp = self.weight.shape
        dev, dtype = self.weight.device, self.weight.dtype
        self.lora_A = torch.nn.Parameter(torch.zeros(rank, inp, device=dev, dtype=dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(out, rank, device=dev, dtype=dtype))

    def _lora_dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout > 0 else x


class LoRAColumnParallelLinear(_LoRA, ColumnParallelLinear):
    """ColumnParallelLinear + LoRA (module docstring); the instance's class is switched by `apply_lora`."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        out, bias = super().forward(input_, weight, runtime_gather_output)
        x = input_
        if self.sequence_parallel:  # A needs the whole sequence, like W; its gradient comes back split
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=self.tp_group)
        h = F.linear(self._lora_dropout(x), self.lora_A)
        if self.tp_group.size() > 1:  # backward: A's output gradient summed over the ranks' B slices
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        return out + F.linear(h, self.lora_B) * self.lora_scale, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0, "bias": 0, "lora_B": 0}, sharded_offsets,
                                                  tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        if getattr(self, "lora_swiglu", False):  # stored as [gate; up] like fc1's weight (MLP does that for weight)
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            out[f"{prefix}lora_B"] = apply_swiglu_sharded_factory(
                out[f"{prefix}lora_B"], sharded_offsets, metadata.get("singleton_local_shards", False),
                tp_group=self.tp_group, dp_group=metadata["dp_cp_group"])
        return out


class LoRARowParallelLinear(_LoRA, RowParallelLinear):
    """RowParallelLinear + LoRA (module docstring); the instance's class is switched by `apply_lora`."""

    def forward(self, input_):
        out, bias = super().forward(input_)
        h = F.linear(self._lora_dropout(input_), self.lora_A)  # this rank's partial sum
        if self.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
        elif self.tp_group.size() > 1:
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return out + F.linear(h, self.lora_B) * self.lora_scale, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 1, "lora_A": 1}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


def _adapt(module, name: str, chunk, rank: int, alpha: float, dropout: float, seed: int, gated: bool) -> None:
    column = isinstance(module, ColumnParallelLinear)
    tp = module.tp_group.size()
    in_local = module.weight.shape[1]
    in_full = in_local if column else in_local * tp
    module.__class__ = LoRAColumnParallelLinear if column else LoRARowParallelLinear
    module.lora_scale, module.lora_dropout = alpha / rank, dropout
    module._lora_params(rank)
    if column:
        module.lora_B.tensor_model_parallel, module.lora_B.partition_dim, module.lora_B.partition_stride = True, 0, 1
    else:
        module.lora_A.tensor_model_parallel, module.lora_A.partition_dim, module.lora_A.partition_stride = True, 1, 1
        if module.sequence_parallel:  # each rank's B gradient covers its part of the sequence: summed over TP
            module.lora_B.sequence_parallel = True
    gname = global_name(f"{name}.lora_A", chunk)
    bound = 1.0 / math.sqrt(in_full)
    full = torch.empty(rank, in_full).uniform_(-bound, bound, generator=_generator(gname, seed))
    with torch.no_grad():
        module.lora_A.copy_(local_shard(full, module.lora_A, gname, gated).to(module.lora_A.dtype))
    if column and gated and name.endswith("linear_fc1"):
        module.lora_swiglu = True  # the checkpoint stores B like fc1's weight: [gate; up]


def apply_lora(chunks: List[torch.nn.Module], cfg) -> str:
    """Add LoRA adapters to the `--lora-target` layers of every (unwrapped) chunk and freeze everything else.
    Returns a one-line report."""
    targets = resolve_targets(cfg.lora_target, cfg.swiglu)
    adapted: Dict[str, int] = {}
    skipped_experts = 0
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        for name, module in list(chunk.named_modules()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in targets or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            if ".experts." in name:
                skipped_experts += 1
                continue
            _adapt(module, name, chunk, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.seed, cfg.swiglu)
            adapted[leaf] = adapted.get(leaf, 0) + 1
    if not adapted:
        raise ValueError(f"--lora-target {' '.join(cfg.lora_target)}: no such layer in this model")
    trainable = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
    frozen = sum(p.numel() for c in chunks for p in c.parameters() if not p.requires_grad)
    where = ", ".join(f"{k} x{v}" for k, v in adapted.items())
    note = f"; {skipped_experts} expert layers not adapted" if skipped_experts else ""
    return (f"LoRA rank {cfg.lora_rank}, alpha {cfg.lora_alpha:g}, dropout {cfg.lora_dropout:g} on {where} (this "
            f"rank): {trainable / 1e6:.3f}M trainable parameters, {frozen / 1e6:.1f}M frozen{note}")

