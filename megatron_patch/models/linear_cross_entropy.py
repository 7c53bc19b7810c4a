"""Fused output layer + cross entropy (`--cross-entropy-loss-fusion --cross-entropy-fusion-impl linear`).

megatron-core's loss path materialises the whole logits of a micro batch: the output layer writes
[s, b, V/tp] in bf16, and the vocab-parallel cross entropy copies them to fp32 and turns that copy, in place,
into the softmax it keeps for the backward pass. For 8192 tokens and a 32k vocabulary that is 0.5 GB + 1 GB
per micro batch, the 1 GB held until the backward pass (which adds 0.5 GB of bf16 gradient). Here the tokens go through
the output weight a chunk at a time: a chunk's logits live only while its softmax statistics (forward) or
its gradient (backward) are taken, so the memory is bounded by `chunk_bytes`, whatever the micro batch.

Numerics follow megatron-core's path: the matrix multiplications run in the input dtype (bf16 logits, as
the output layer gives them), the softmax statistics in fp32, and vocab-parallel like
`tensor_parallel.vocab_parallel_cross_entropy`: each TP rank holds V/tp rows of the weight; the maximum logit
is all-reduced with MAX, the sum of exponentials and the target's logit with SUM. Rows of the padded
vocabulary (ids >= the tokenizer's vocabulary) get logit -inf, as GPTModelWithVocab does before megatron-core's
loss: they take no probability and no gradient.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

# fp32 logits of one chunk at most this large (the backward pass holds about twice this at its peak: the
# chunk's logits in the input dtype, their fp32 softmax and its gradient in the input dtype).
CHUNK_BYTES = 256 * 2**20


def chunk_tokens(local_vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that a chunk's fp32 logits [tokens, local_vocab] stay within `chunk_bytes`;
    a multiple of 256 when that large (full tiles for the GPU's matrix multiplications)."""
    n = max(1, chunk_bytes // (4 * local_vocab))
    return n - n % 256 if n >= 256 else n


class LinearCrossEntropy(torch.autograd.Function):
    """loss[i] = logsumexp(x_i W^T) - (x_i W^T)[label_i] over the real vocabulary, for x [N, h] (this TP rank's
    full copy of the tokens), W [V/tp, h] (this rank's rows), labels [N] (global ids); loss [N] in fp32.

    The gradient of x is this rank's part only (its vocabulary rows); the caller sums it over the TP group,
    as megatron-core's output layer does (`linear_cross_entropy` below does both).

    Gradients are recomputed in the backward pass rather than computed during the forward pass (Liger's way).
    Computing them early saves one matrix multiplication of the output layer per chunk (its forward again),
    but it needs the gradient of each token's loss to be known in the forward pass: Liger reduces the loss
    to a mean inside the kernel and scales by the scalar upstream gradient afterwards. megatron-core's loss
    is per token ([b, s], masked and averaged by the training step's loss function, then scaled by 1 / micro
    batches and the fp16 loss scale), so the upstream gradient is a vector known only in backward, and the
    weight's gradient sum_i g_i dlogits_i^T x_i cannot be rescaled afterwards. Early gradients would also
    keep a weight-sized fp32 gradient and a hidden-sized gradient alive from each micro batch's forward to
    its backward: with pipeline parallelism several micro batches are in flight. The price of recomputing
    is one extra [N, h] x [h, V/tp] multiplication, about 1.5% of a step's FLOPs for the Llama 1.3B shape.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                real_vocab: int, tp_group, chunk: int) -> torch.Tensor:
        n, local_vocab = hidden.size(0), weight.size(0)
        # labels on this rank's rows (the whole local slice, padding included, as megatron-core masks them)
        target = labels - vocab_start
        on_rank = (target >= 0) & (target < local_vocab)
        target = torch.where(on_rank, target, torch.zeros_like(target))
        local_max = torch.empty(n, dtype=torch.float32, device=hidden.device)
        local_sum = torch.empty_like(local_max)
        target_logit = torch.empty_like(local_max)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            logits = F.linear(hidden[start:end], weight).float()
            if real_vocab < local_vocab:
                logits[:, real_vocab:] = float("-inf")
            target_logit[start:end] = logits.gather(1, target[start:end, None]).squeeze(1)
            m = logits.amax(dim=1)
            local_max[start:end] = m
            # A rank whose rows are all padding has m = -inf; exp(-inf - 0) = 0 keeps its sum at 0.
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            local_sum[start:end] = logits.sub_(m[:, None]).exp_().sum(dim=1)
        target_logit = torch.where(on_rank, target_logit, torch.zeros_like(target_logit))
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            # One all-reduce each for the whole micro batch: every chunk kept its own local statistics.
            global_max = local_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
            sums = torch.stack([local_sum * torch.exp(local_max - global_max), target_logit])
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
            total, target_logit = sums[0], sums[1]
        else:
            global_max, total = local_max, local_sum
        lse = global_max + torch.log(total)
        ctx.save_for_backward(hidden, weight, target, on_rank, lse)
        ctx.real_vocab, ctx.chunk = real_vocab, chunk
        return lse - target_logit

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, target, on_rank, lse = ctx.saved_tensors
        real_vocab, chunk = ctx.real_vocab, ctx.chunk
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, local_vocab = hidden.size(0), weight.size(0)
        grad_loss = grad_loss.float()
        hit = on_rank.float()[:, None]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # The weight's gradient sums over chunks: accumulated in fp32, rounded to the weight's dtype once.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            x = hidden[start:end]
            logits = F.linear(x, weight).float()
            if real_vocab < local_vocab:
                logits[:, real_vocab:] = float("-inf")
            # d loss_i / d logits_i = g_i * (softmax_i - onehot(label_i)); padded rows: exp(-inf) = 0
            grad = logits.sub_(lse[start:end, None]).exp_()
            grad.scatter_add_(1, target[start:end, None], -hit[start:end])
            grad = grad.mul_(grad_loss[start:end, None]).to(hidden.dtype)
            if need_hidden:
                grad_hidden[start:end] = grad @ weight
            if need_weight:
                grad_weight.add_(grad.t() @ x)  # a bf16 product added into fp32: no fp32 copy of it
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                         tp_group=None, sequence_parallel: bool = False,
                         chunk_size: Optional[int] = None) -> torch.Tensor:
    """Per-token loss [b, s] (fp32) of the output layer `weight` and cross entropy, without full logits.

    hidden: [s, b, h] as the output layer takes it (after the final norm; with `sequence_parallel`, this rank's
        part of the sequence, gathered here as megatron-core's ColumnParallelLinear gathers it).
    weight: this TP rank's rows of the (padded) output weight, [V_padded / tp, h]; the embedding with tied
        embeddings. Its gradient comes back through autograd (megatron-core DDP's hooks accumulate it).
    labels: [b, s] token ids; vocab_size: the tokenizer's vocabulary (rows from it on are padding);
    tp_group: the tensor-parallel group the vocabulary is split over (None: not split).
    chunk_size: tokens per chunk (default: fp32 logits of a chunk within CHUNK_BYTES).
    """
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    rank = dist.get_rank(tp_group) if tp > 1 else 0
    # With sequence parallelism the gathered [s, b, h] is what the backward pass keeps (megatron-core's output layer
    # keeps its shard and gathers again): tp x h per token more, small beside the logits that are not kept.
    if sequence_parallel and tp > 1:  # all-gather now, reduce-scatter of the gradient in backward
        hidden = gather_from_sequence_parallel_region(hidden, group=tp_group)
    elif tp > 1:  # identity now, all-reduce of the gradient (each rank's vocabulary rows add to it) in backward
        hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    s, b, h = hidden.shape
    local_vocab = weight.size(0)
    if weight.size(1) != h:
        raise ValueError(f"output weight {tuple(weight.shape)} does not match hidden size {h}")
    if tuple(labels.shape) != (b, s):
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden states [s={s}, b={b}]: expected [b, s]")
    vocab_start = rank * local_vocab
    real_vocab = min(max(vocab_size - vocab_start, 0), local_vocab)
    chunk = chunk_size or chunk_tokens(local_vocab)
    loss = LinearCrossEntropy.apply(hidden.reshape(s * b, h), weight, labels.t().reshape(s * b), vocab_start,
                                    real_vocab, tp_group if tp > 1 else None, chunk)
    return loss.view(s, b).t().contiguous()
