"""`--moe-grouped-gemm`: the experts of each MoE layer as two grouped GEMMs instead of one GEMM pair per expert.

megatron-core's local spec runs the experts as a SequentialMLP: per micro batch and layer, two GEMMs per expert
forward and four backward, each over only that expert's tokens (small GEMMs and many launches when experts
are many). Megatron-LM's `--moe-grouped-gemm` needs Transformer Engine's GroupedLinear or the grouped_gemm
package, neither of which the GPU image has. torch._grouped_mm multiplies every expert's rows by that
expert's weight in one call (torch 2.11: one CUTLASS kernel on Hopper in bf16, its per-group fallback for other
dtypes and devices). The group boundaries go to the device with a non-blocking copy, so the grouped path adds
no wait on the GPU (the token dispatcher's own synchronisation stays).

The parameters stay SequentialMLP's (`local_experts.{i}.linear_fc1/linear_fc2`), so checkpoints, conversion and
--load-hf are unchanged and runs with and without the flag resume each other's checkpoints. Each GEMM stacks
the experts' weights into [experts, out, in] for the call and again in backward, saving only the parameters
themselves for backward (autograd would keep the stacked copy alive for every micro batch in flight: the
size of the layer's expert weights each). The computation is MLP.forward's (megatron/core/transformer/mlp.py,
the branch without fused bias-activation, which this engine uses): fc1, the activation or gated unit, times the
routing probability, fc2. Experts have no biases here (the engine's MoE layers need --disable-bias-linear).
"""
from __future__ import annotations

from typing import Callable, Iterable, Tuple

import torch

from megatron_patch.compat.moe import route_experts_through


def _activation(config, x: torch.Tensor) -> torch.Tensor:
    """MLP.forward's activation, non-fused branch."""
    if not config.gated_linear_unit:
        return config.activation_func(x)
    x_glu, x_linear = torch.chunk(x, 2, dim=-1)
    if (clamp := config.activation_func_clamp_value) is not None:
        x_glu = x_glu.clamp(min=None, max=clamp)
        x_linear = x_linear.clamp(min=-clamp, max=clamp)
    return config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)


class _GroupedLinear(torch.autograd.Function):
    """y[rows of expert e] = x[rows of expert e] @ weight_e^T for the experts' [out, in] weights, the rows of
    expert e ending at offsets[e]; saves the weights, not their stacked copy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offsets: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, offsets, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, offsets, *weights = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, torch.stack(weights), offs=offsets)  # dy_e @ W_e
        if any(ctx.needs_input_grad[2:]):
            grad_w = torch._grouped_mm(grad.t(), x, offs=offsets).unbind(0)  # dy_e^T @ x_e, [experts, out, in]
        return (grad_x, None, *(grad_w if grad_w is not None else [None] * len(weights)))


def grouped_expert_mlp(experts: torch.nn.Module, hidden: torch.Tensor, tokens_per_expert: torch.Tensor,
                       probs: torch.Tensor) -> Tuple[torch.Tensor, None]:
    """What SequentialMLP.forward(hidden, tokens_per_expert, probs) returns, with grouped GEMMs: `hidden` holds
    the tokens of local expert 0, then 1, ... ([tokens, hidden], counts in `tokens_per_expert`), `probs` their
    routing probabilities."""
    config = experts.config
    if config.moe_apply_probs_on_input:  # as upstream: the probability scales the input, the MLP gets ones
        dtype = hidden.dtype
        hidden = (probs.unsqueeze(-1) * hidden).to(dtype)
        probs = torch.ones_like(probs)
    fc1 = [e.linear_fc1.weight for e in experts.local_experts]
    fc2 = [e.linear_fc2.weight for e in experts.local_experts]
    # The end row of each expert's tokens. The dispatchers give the counts on the host: sum them there and
    # copy without blocking (a blocking copy would wait for all queued GPU work).
    offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32).to(hidden.device, non_blocking=True)
    x = _GroupedLinear.apply(hidden, offsets, *fc1)
    x = _activation(config, x)
    dtype = x.dtype
    x = (x * probs.unsqueeze(-1)).to(dtype)
    return _GroupedLinear.apply(x, offsets, *fc2), None


def _make_forward(experts: torch.nn.Module) -> Callable:
    upstream = experts.forward

    def forward(permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor, **kwargs):
        if experts.num_local_experts == 1 or kwargs:  # one GEMM pair either way / a call this path does not know
            return upstream(permuted_local_hidden_states, tokens_per_expert, permuted_probs, **kwargs)
        return grouped_expert_mlp(experts, permuted_local_hidden_states, tokens_per_expert, permuted_probs)

    return forward


def check_experts(experts: torch.nn.Module) -> None:
    """ValueError, naming the flag, for experts the grouped path does not compute."""
    config = experts.config
    if experts.tp_group is not None and experts.tp_group.size() > 1:
        raise ValueError("--moe-grouped-gemm runs each expert whole on its rank: expert tensor parallelism "
                         f"({experts.tp_group.size()}) is not supported; pass --expert-tensor-parallel-size 1")
    if any(e.linear_fc1.bias is not None or e.linear_fc2.bias is not None for e in experts.local_experts):
        raise ValueError("--moe-grouped-gemm computes experts without biases: pass --disable-bias-linear")
    if config.bias_activation_fusion or config.use_te_activation_func or config.fp8 or config.fp4:
        raise ValueError("--moe-grouped-gemm computes the experts' activation unfused, in bf16/fp16/fp32: "
                         "bias-activation fusion, Transformer Engine activations and fp8/fp4 are not supported")


def apply_grouped_experts(chunks: Iterable[torch.nn.Module]) -> str:
    """Route every MoE layer's SequentialMLP in `chunks` through grouped GEMMs. Returns the log line."""
    grouped = 0  # layers with several local experts (one expert per rank keeps upstream's path)

    def make(experts: torch.nn.Module) -> Callable:
        nonlocal grouped
        check_experts(experts)
        experts.grouped_gemm = experts.num_local_experts > 1  # read by --gradient-accumulation-fusion's log
        grouped += experts.grouped_gemm
        return _make_forward(experts)

    route_experts_through(chunks, make)
    return (f"MoE grouped GEMM: the experts of {grouped} MoE layers run as two torch._grouped_mm calls per layer "
            f"and micro batch" + ("" if grouped else " (none: one expert per rank runs as one GEMM pair anyway)"))
