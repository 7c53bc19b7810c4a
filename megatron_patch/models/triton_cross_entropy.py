"""Triton cross entropy of the logits, vocab-parallel
(`--cross-entropy-loss-fusion --cross-entropy-fusion-impl triton`).

megatron-core's `tensor_parallel.vocab_parallel_cross_entropy` makes several passes over the logits [s, b, V/tp]:
an fp32 copy of the bf16 logits, max, subtract, exp, sum, divide (the softmax it keeps for backward), and more in
backward; GPTModelWithVocab masks the padded vocabulary in place before it (`mask_vocab_padding`), one more.
Here the forward pass is one Triton kernel that reads each row once and writes three fp32 numbers per row, and
the backward pass one kernel that reads each row once more and writes the gradient into the logits' own buffer:

* forward, one program per row (token): an online softmax over blocks of BLOCK columns of this rank's vocabulary
  slice, in fp32 whatever the logits' dtype: the running maximum m and sum of exp(x - m) (rescaled by
  exp(m_old - m_new) when the maximum grows), and the target's logit if the label falls in this rank's slice.
  The padded vocabulary (ids >= the tokenizer's vocabulary) is a column bound, not a masking pass: the loop stops
  at the block of the last real column, and in that block the columns past it count as -inf.
* the TP combine, on [s*b] vectors: all-reduce MAX of the maxima; each rank rescales its sum by
  exp(local max - global max) (a rank whose slice is all padding has max -inf and sum 0); all-reduce SUM of the
  sums and of the target logits (0 on the ranks that do not hold the label). loss = log(sum) - (target - max),
  as megatron-core computes it.
* backward, one program per row: grad = (exp(x - max) / sum - onehot(label on this rank)) * grad_output[row],
  megatron-core's formula and order of operations, in fp32, rounded once to the logits' dtype (bf16: to nearest
  even, like the `.float()` that megatron-core's path differentiates through) and written over the logits.
  Padded columns get 0.

Writing the gradient over the logits is safe because nothing else keeps them for backward: megatron-core's output
layer (ColumnParallelLinear -> linear_with_grad_accumulation_and_async_allreduce ->
LinearWithGradAccumulationAndAsyncCommunication, and LinearWithFrozenWeight) saves its input and weight only
(`ctx.save_for_backward(input, weight)`), not its output, and GPTModel._postprocess hands the logits to the loss
and nowhere else when labels are given (megatron-core 0.19.2; megatron-core's own cross entropy already subtracts the
maximum in place in fp32 runs, where its `.float()` returns the logits themselves). The kernel writes behind
autograd's back, so the logits' version counter is bumped after the write: a consumer that did save them would get
autograd's "modified by an inplace operation" error instead of wrong gradients. For the same reason a second
backward through the same graph (retain_graph=True) is refused.

Numerics against megatron-core's path (fp32 softmax statistics either way): the loss and the gradient use the same
formulas; the sum of exponentials is accumulated block by block with rescaling instead of once after the global
maximum, a difference of float rounding (about 1e-7 relative). On the GPU Triton's exp and division are its fast
approximations (ex2.approx.f32 and div.full.f32 in the PTX, a few ulp), megatron-core's are torch's.

TRITON_INTERPRET=1 runs the kernels in Triton's interpreter (numpy, on the CPU tensors), which is how the tests run
without a GPU. triton.jit reads the variable when it decorates a function, so the kernels are decorated on first
use (once per setting, models/triton_jit.py), not at import. Three limits of the interpreter (Triton 3.6, numpy 2.5) shape the kernels:

* Triton's own library functions written in Triton (tl.max, tl.sum, tl.zeros, ... in triton.language.standard)
  are decorated when triton is imported, and megatron-core imports it early: imported without the variable, they
  raise "Cannot call @triton.jit'd outside of the scope of a kernel" inside an interpreted kernel. The kernels
  therefore use builtins only: tl.reduce with tl.standard's combine functions (what tl.max and tl.sum call on fp32,
  and what the interpreter maps to numpy's max and sum) and tl.full. With that, TRITON_INTERPRET=1 may be set at any
  time before the first call, in a process that imported triton already.
* a loop bound must be a tl.constexpr (a runtime integer argument becomes a one-element array there, and
  `range(0, n, BLOCK)` fails on it), so the vocabulary slice's widths are constexpr (one compilation per rank's
  slice shape on the GPU);
* its fp32 -> bf16 cast truncates instead of rounding to nearest even, so the kernel rounds bf16 itself with
  integer operations (on the GPU the same bits as the hardware's round-to-nearest-even cast, for a few integer
  operations per element).

tests/test_triton_cross_entropy.py also compiles both kernels for sm_90 on the CPU (Triton's CUDA backend and its
ptxas need no GPU), so the GPU code path is compiled by the tests, though not run.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .triton_jit import jit

try:  # the kernels' language; the wheel comes with torch's CUDA builds (validate() checks before a run)
    import triton.language as tl
except ImportError:  # pragma: no cover
    tl = None

# Columns of the vocabulary slice one program handles per loop step (a power of two).
MAX_BLOCK = 4096


def _forward_kernel(logits_ptr, labels_ptr, stats_ptr, n_rows, vocab_start,
                    N_REAL: tl.constexpr, N_COLS: tl.constexpr, BLOCK: tl.constexpr):
    """stats[0, row] = max of the row's real columns, stats[1, row] = sum of exp(x - that max), stats[2, row] =
    the label's logit if it falls in this slice (-inf if on a padded column), else 0."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * N_COLS
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    for start in range(0, N_REAL, BLOCK):  # blocks of padding only (N_REAL..N_COLS) are not read
        cols = start + tl.arange(0, BLOCK)
        # The padding is a column bound: -inf from N_REAL on. (Loading up to N_COLS, a multiple of the padding's
        # multiple, and bounding afterwards keeps the loads vectorized; an odd N_REAL in the mask would not.)
        x = tl.load(base + cols, mask=cols < N_COLS, other=float("-inf")).to(tl.float32)
        x = tl.where(cols < N_REAL, x, float("-inf"))
        # tl.max / tl.sum written out as the reductions they are (see the module's docstring)
        m_new = tl.maximum(m, tl.reduce(x, 0, tl.standard._elementwise_max))  # finite: a block has a real column
        s = s * tl.exp(m - m_new) + tl.reduce(tl.exp(x - m_new), 0, tl.standard._sum_combine)  # first: 0 * 0
        m = m_new
    target = tl.load(labels_ptr + row) - vocab_start
    on_rank = (target >= 0) & (target < N_COLS)
    real = on_rank & (target < N_REAL)
    x_target = tl.load(base + tl.where(real, target, 0)).to(tl.float32)
    x_target = tl.where(real, x_target, float("-inf"))  # a label on a padded column: -inf, loss +inf (as masked)
    x_target = tl.where(on_rank, x_target, 0.0)
    tl.store(stats_ptr + row, m)
    tl.store(stats_ptr + n_rows + row, s)
    tl.store(stats_ptr + 2 * n_rows + row, x_target)


def _backward_kernel(logits_ptr, labels_ptr, max_ptr, sum_ptr, grad_ptr, vocab_start,
                     N_REAL: tl.constexpr, N_COLS: tl.constexpr, BLOCK: tl.constexpr,
                     TO_BF16: tl.constexpr):
    """logits[row] <- (exp(x - max) / sum - onehot(label)) * grad[row], padded columns 0 (for real labels)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * N_COLS
    m = tl.load(max_ptr + row)
    s = tl.load(sum_ptr + row)
    g = tl.load(grad_ptr + row)
    target = tl.load(labels_ptr + row) - vocab_start  # off this rank: outside [0, N_COLS), matches no column
    for start in range(0, N_COLS, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < N_COLS, other=float("-inf")).to(tl.float32)
        x = tl.where(cols < N_REAL, x, float("-inf"))  # padded columns: probability 0
        p = tl.exp(x - m) / s
        p = tl.where(cols == target, p - 1.0, p)
        grad = p * g
        if TO_BF16:  # round to nearest even by hand (the interpreter's cast truncates)
            bits = grad.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            out = grad.to(logits_ptr.dtype.element_ty)
        tl.store(base + cols, out, mask=cols < N_COLS)


def _kernels():
    """(forward, backward) decorated for the current TRITON_INTERPRET setting (see the module's docstring)."""
    return jit(_forward_kernel), jit(_backward_kernel)


def _launch_config(local_vocab: int, block_size: int | None) -> dict:
    block = block_size or min(MAX_BLOCK, 1 << max(local_vocab - 1, 0).bit_length())
    if block & (block - 1):
        raise ValueError(f"block_size {block} must be a power of two")
    # Not tuned yet (GPU speed not measured): more warps for wider blocks.
    return dict(BLOCK=block, num_warps=16 if block >= 4096 else 8 if block >= 1024 else 4)


def _on_device(t: torch.Tensor):
    """Launch on the tensor's GPU (Triton launches on the current device); nothing to do on the CPU."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


class TritonVocabParallelCrossEntropy(torch.autograd.Function):
    """loss[i] = logsumexp over the real vocabulary of the logits of row i minus its label's logit; logits
    [N, V/tp] (this rank's slice, contiguous), labels [N] (global ids); loss [N] in fp32. The logits' gradient is
    written into the logits' buffer (see the module's docstring)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, real_vocab: int, tp_group,
                block_size):
        n, local_vocab = logits.shape
        fwd, _ = _kernels()
        launch = _launch_config(local_vocab, block_size)
        stats = torch.empty(3, n, dtype=torch.float32, device=logits.device)
        if n:
            with _on_device(logits):
                fwd[(n,)](logits, labels, stats, n, vocab_start, N_REAL=real_vocab, N_COLS=local_vocab, **launch)
        local_max, total, target_logit = stats[0], stats[1], stats[2]  # views: the all-reduces update them
        if tp_group is not None:
            global_max = local_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
            # Rescale each rank's sum to the global maximum; all padding: max -inf, sum 0, exp(-inf) = 0.
            total.mul_(torch.exp(local_max - global_max))
            dist.all_reduce(stats[1:], op=dist.ReduceOp.SUM, group=tp_group)  # sums and target logits together
        else:
            global_max = local_max
        loss = torch.log(total) - (target_logit - global_max)  # megatron-core's: log(sum) - (target - max)
        ctx.save_for_backward(logits, labels, global_max, total)
        ctx.vocab_start, ctx.real_vocab, ctx.launch = vocab_start, real_vocab, launch
        ctx.used = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.used:
            raise RuntimeError("the Triton cross entropy wrote its gradient over the logits in the first backward "
                               "pass; it cannot be differentiated twice (retain_graph): use another "
                               "--cross-entropy-fusion-impl")
        ctx.used = True
        logits, labels, global_max, total = ctx.saved_tensors
        n, local_vocab = logits.shape
        grad_loss = grad_loss.float().contiguous()
        _, bwd = _kernels()
        if n:
            with _on_device(logits):
                bwd[(n,)](logits, labels, global_max, total, grad_loss, ctx.vocab_start, N_REAL=ctx.real_vocab,
                          N_COLS=local_vocab, TO_BF16=logits.dtype == torch.bfloat16, **ctx.launch)
        torch.autograd.graph.increment_version(logits)  # written in place, behind autograd's back
        return logits, None, None, None, None, None


def triton_vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, tp_group=None,
                                        block_size: int | None = None) -> torch.Tensor:
    """Per-token loss [b, s] (fp32), what GPTModelWithVocab.compute_language_model_loss returns unfused
    (mask_vocab_padding + megatron-core's vocab_parallel_cross_entropy), from one read of the logits.

    logits: [s, b, V_padded / tp], this TP rank's slice of the padded vocabulary, as the output layer gives them
        (fp32, bf16 or fp16). Their buffer receives their gradient in backward: do not use them after the loss.
    labels: [b, s] token ids, as GPTModel hands them to compute_language_model_loss.
    vocab_size: the tokenizer's vocabulary (columns from it on are padding, -inf for the softmax).
    tp_group: the tensor-parallel group the vocabulary is split over (None or size 1: not split).
    block_size: columns per loop step of the kernels (a power of two; default min(4096, next power of two of V/tp)).
    """
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    rank = dist.get_rank(tp_group) if tp > 1 else 0
    s, b, local_vocab = logits.shape
    if tuple(labels.shape) != (b, s):
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits [s={s}, b={b}, V/tp]: expected [b, s]")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits in {logits.dtype}: the Triton cross entropy takes fp32, bf16 or fp16")
    if not logits.is_contiguous() or (logits.requires_grad and logits.is_leaf):
        logits = logits.contiguous() if not logits.is_contiguous() else logits.clone()  # ours: takes the gradient
    vocab_start = rank * local_vocab
    real_vocab = min(max(vocab_size - vocab_start, 0), local_vocab)
    flat_labels = labels.t().reshape(s * b).to(torch.int64).contiguous()  # row order of the logits: [s, b]
    loss = TritonVocabParallelCrossEntropy.apply(logits.view(s * b, local_vocab), flat_labels, vocab_start,
                                                 real_vocab, tp_group if tp > 1 else None, block_size)
    return loss.view(s, b).t().contiguous()
