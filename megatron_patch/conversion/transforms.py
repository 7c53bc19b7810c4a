"""The named transforms between Hugging Face tensors and megatron-core's global tensors.

Each transform maps the Hugging Face tensors of one rule to one megatron-core tensor (`to_mcore`) and
back (`to_hf`), exactly: `to_hf(to_mcore(x)) == x` bit for bit. They work on *global* tensors, in
megatron-core's layout that does not depend on the tensor-parallel size:

- QKV: megatron-core fuses the three projections and orders the rows by query group: for each group
  g, its query heads, then its key head, then its value head (so a TP rank's rows are whole groups).
  Hugging Face keeps q_proj/k_proj/v_proj (Llama, Qwen2, Mistral), or one fused [Q; K; V] (GPT-2).
- SwiGLU: megatron-core's linear_fc1 is [gate; up]; Hugging Face has gate_proj and up_proj.
- GPT-2's Conv1D stores weights as [in, out]; torch Linear (megatron-core) as [out, in].
- Vocabulary: megatron-core's embedding and output layer have the padded number of rows; the padding
  rows are zero on import and dropped on export.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch


@dataclass(frozen=True)
class Dims:
    """The sizes the transforms need, all from the model's configuration."""
    heads: int
    groups: int
    head_dim: int
    vocab: int  # the model's vocabulary (Hugging Face's config vocab_size)
    padded_vocab: int  # megatron-core's embedding rows


class Transform:
    """One Hugging Face tensor group <-> one megatron-core tensor. Subclasses override both directions."""

    name = "identity"

    def to_mcore(self, hf: List[torch.Tensor], d: Dims) -> torch.Tensor:
        (t,) = hf
        return t

    def to_hf(self, t: torch.Tensor, d: Dims) -> List[torch.Tensor]:
        return [t]


class Transpose(Transform):
    """GPT-2's Conv1D [in, out] <-> Linear [out, in]."""

    name = "conv1d_transpose"

    def to_mcore(self, hf, d):
        (t,) = hf
        return t.t().contiguous() if t.dim() == 2 else t

    def to_hf(self, t, d):
        return [t.t().contiguous() if t.dim() == 2 else t]


class FuseQKV(Transform):
    """q, k, v (weights [rows, hidden] or biases [rows]) <-> megatron-core's grouped QKV."""

    name = "fuse_qkv"

    def to_mcore(self, hf, d):
        q, k, v = hf
        tail = q.shape[1:]
        per_group = d.heads // d.groups * d.head_dim
        q = q.reshape(d.groups, per_group, *tail)
        k = k.reshape(d.groups, d.head_dim, *tail)
        v = v.reshape(d.groups, d.head_dim, *tail)
        return torch.cat([q, k, v], dim=1).reshape(-1, *tail)

    def to_hf(self, t, d):
        tail = t.shape[1:]
        per_group = d.heads // d.groups * d.head_dim
        g = t.reshape(d.groups, per_group + 2 * d.head_dim, *tail)
        q, k, v = torch.split(g, [per_group, d.head_dim, d.head_dim], dim=1)
        return [x.reshape(-1, *tail).contiguous() for x in (q, k, v)]


class FusedQKVConv1D(Transform):
    """GPT-2's c_attn (Conv1D weight [hidden, 3*hidden] = [Q | K | V] columns, or bias [3*hidden])."""

    name = "conv1d_fused_qkv"

    def to_mcore(self, hf, d):
        (t,) = hf
        t = t.t() if t.dim() == 2 else t
        return FuseQKV().to_mcore(list(torch.chunk(t, 3, dim=0)), d)

    def to_hf(self, t, d):
        fused = torch.cat(FuseQKV().to_hf(t, d), dim=0)
        return [fused.t().contiguous() if fused.dim() == 2 else fused]


class FuseGateUp(Transform):
    """gate_proj, up_proj <-> SwiGLU linear_fc1 [gate; up]."""

    name = "fuse_gate_up"

    def to_mcore(self, hf, d):
        return torch.cat(hf, dim=0)

    def to_hf(self, t, d):
        return [x.contiguous() for x in torch.chunk(t, 2, dim=0)]


class PadVocab(Transform):
    """[vocab, hidden] <-> [padded_vocab, hidden]: zero rows appended on import, dropped on export."""

    name = "pad_vocab"

    def to_mcore(self, hf, d):
        (t,) = hf
        if t.shape[0] != d.vocab:
            raise ValueError(f"has {t.shape[0]} rows, but the config's vocab_size is {d.vocab}")
        pad = t.new_zeros(d.padded_vocab - d.vocab, *t.shape[1:])
        return torch.cat([t, pad], dim=0)

    def to_hf(self, t, d):
        return [t[: d.vocab].contiguous()]


IDENTITY, TRANSPOSE, FUSE_QKV, CONV1D_QKV, FUSE_GATE_UP, PAD_VOCAB = (
    Transform(), Transpose(), FuseQKV(), FusedQKVConv1D(), FuseGateUp(), PadVocab())
