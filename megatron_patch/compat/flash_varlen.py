"""Variable-length flash attention with attention dropout, for padding-free fine-tuning (accelerations/padding_free.py).

torch 2.11's public `torch.nn.attention.varlen.varlen_attn` runs the flash kernels on packed sequences
(`cu_seq_q`/`cu_seq_k`), but hard-codes dropout_p = 0.0 in its forward and backward. BERT-family models are
fine-tuned with attention-probability dropout (0.1 in BERT's config), and the padded run they are compared with
applies it. So we call the same private ATen kernels the same way torch's varlen module does
(`aten::_flash_attention_forward` / `_backward` inside a custom op with its own autograd, opaque to
torch.compile), passing the dropout probability and handing the forward's random-number state (`rng_state`, the
philox seed and offset as a CUDA tensor, graph-safe) to the backward, which regenerates the same mask.
CUDA only, fp16/bf16 (the flash kernels' limits); the caller falls back to SDPA with a block-diagonal mask
elsewhere.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .registry import register

_U64 = torch.uint64


@torch.library.custom_op("megatron_patch::flash_varlen_fwd", mutates_args=())
def _flash_varlen_fwd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq: torch.Tensor,
                      max_len: int, dropout_p: float, is_causal: bool,
                      scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, lse, rng_state, _, _ = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seq, cu_seq, max_len, max_len, dropout_p, is_causal, False, scale=scale)
    if dropout_p == 0.0:  # no random numbers drawn: the state the backward gets is not read (as torch's varlen)
        rng_state = torch.zeros((2,), dtype=_U64, device=query.device)
    return out, lse, rng_state


@_flash_varlen_fwd.register_fake
def _flash_varlen_fwd_fake(query, key, value, cu_seq, max_len, dropout_p, is_causal, scale):
    # torch/_meta_registrations.py meta__flash_attention_forward, the varlen (3-D) case
    return (torch.empty_like(query), query.new_empty((query.size(1), query.size(0)), dtype=torch.float),
            torch.empty((2,), dtype=_U64, device=query.device))


@torch.library.custom_op("megatron_patch::flash_varlen_bwd", mutates_args=())
def _flash_varlen_bwd(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      out: torch.Tensor, lse: torch.Tensor, cu_seq: torch.Tensor, max_len: int, dropout_p: float,
                      is_causal: bool, rng_state: torch.Tensor,
                      scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    unused = torch.empty(0, device=query.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(), query, key, value, out, lse, cu_seq, cu_seq, max_len, max_len, dropout_p, is_causal,
        rng_state, unused, scale=scale)
    return dq, dk, dv


@_flash_varlen_bwd.register_fake
def _flash_varlen_bwd_fake(grad_out, query, key, value, out, lse, cu_seq, max_len, dropout_p, is_causal, rng_state, scale):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, cu_seq, max_len, dropout_p, is_causal, scale = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(query, key, value, cu_seq, out, lse, rng_state)
    ctx.max_len, ctx.dropout_p, ctx.is_causal, ctx.scale = max_len, dropout_p, is_causal, scale


def _backward(ctx, grad_out, grad_lse, grad_rng):
    query, key, value, cu_seq, out, lse, rng_state = ctx.saved_tensors
    dq, dk, dv = torch.ops.megatron_patch.flash_varlen_bwd(grad_out, query, key, value, out, lse, cu_seq, ctx.max_len,
                                                           ctx.dropout_p, ctx.is_causal, rng_state, ctx.scale)
    return dq, dk, dv, None, None, None, None, None


_flash_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


@register(upstream=("torch/nn/attention/varlen.py:_varlen_attn._init_fn",
                    "torch/nn/attention/varlen.py:_varlen_attn_backward._init_fn",
                    "torch/nn/attention/varlen.py:_setup_context",
                    "torch/nn/attention/varlen.py:_backward"),
          fixes="torch's varlen_attn calls aten::_flash_attention_forward/_backward with dropout_p hard-coded to 0.0; "
                "we make the same calls with the attention layer's dropout probability and pass the forward's "
                "rng_state to the backward (a custom op with its own autograd, as torch's)",
          fingerprint="0383a62cfd09a2f4")
def flash_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq: torch.Tensor,
                           max_len: int, dropout_p: float = 0.0, scale: Optional[float] = None,
                           is_causal: bool = False) -> torch.Tensor:
    """Attention within each segment of packed `query`/`key`/`value` [tokens, heads, head_dim] (CUDA, fp16/bf16):
    `cu_seq` [segments + 1] int32 the segments' bounds, `max_len` an upper bound of their lengths. Returns
    [tokens, heads, head_dim]."""
    if scale is None:
        scale = query.size(-1) ** -0.5
    out, _, _ = torch.ops.megatron_patch.flash_varlen_fwd(query, key, value, cu_seq, int(max_len), float(dropout_p),
                                                          bool(is_causal), float(scale))
    return out
