"""FP8 training without Transformer Engine (`--fp8-format`, `--fp8-recipe`): the GEMMs of megatron-core's column- and
row-parallel linears run in float8 through torchao.

Each converted linear's function (megatron-core's `_forward_impl`, swapped through compat/linear.py) becomes: the
tensor-parallel communication megatron-core's linear function does (the sequence-parallel all-gather of the input
with its reduce-scatter in backward, or the all-reduce of the input gradient), then torchao's float8 matmul
(compat/float8.py), whose forward and two backward GEMMs are scaled matmuls (`torch._scaled_mm` on an FP8 GPU;
emulated in fp32 elsewhere, which is how the CPU tests run it).

Recipes (torchao's names; Megatron-LM's `--fp8-recipe`):
- tensorwise (`--fp8-format hybrid`): one scale per tensor, e4m3 weights and activations, e5m2 output gradients.
  The weight, the row-parallel input and the column-parallel output gradient are cast here, once, with the amax
  reduced over the tensor-parallel group, so a shard is scaled as the whole tensor is at TP 1 (the TP run computes
  the same quantised products as the single-GPU run).
- rowwise (`--fp8-format e4m3`): a power-of-two scale per row of each GEMM operand, e4m3 throughout, cast by torchao
  per GEMM. Under tensor parallelism a shard's rows get their own scales (finer, not reduced: not bit-equal to TP 1).

Which linears (`--fp8-layers auto`, the default): those of the transformer layers whose per-rank shapes are
multiples of 16 (a hardware requirement of the FP8 GEMM) and whose full shapes pass torchao's size rule for the
recipe (`_auto_filter_for_tensorwise`/`_rowwise`, measured on H100s: smaller GEMMs run slower in FP8 once the casts
are counted; tensorwise keeps [out, in] with in <= 4096 and out <= 1024 in bf16, rowwise keeps out <= 2048, in <=
1024, or out <= 4096 with in <= 2048); `all` drops the size rule. The output layer stays in bf16, as in
Megatron-LM, and so do experts run as grouped GEMMs and LoRA layers. Weights, gradients and checkpoints stay in
their usual precision: FP8 is only the GEMMs' arithmetic, so an FP8 run resumes without FP8 and the reverse.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_patch.compat.float8 import torchao_float8
from megatron_patch.compat.linear import route_linears_through

RECIPES = ("tensorwise", "rowwise")
_AO = None  # compat's torchao_float8(), set by the first Float8Linear
FORMAT_OF_RECIPE = {"tensorwise": "hybrid", "rowwise": "e4m3"}  # torchao's recipes, in Megatron-LM's format names


def fp8_gemms_available() -> bool:
    """A GPU with FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper, Blackwell)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def keeps_fp8(recipe: str, out_features: int, in_features: int, local_out: int, local_in: int,
              layers: str = "auto") -> bool:
    """The rule of the module docstring: whether a linear of full shape [out, in] (this rank's shard [local_out,
    local_in]) runs in FP8."""
    if local_out % 16 or local_in % 16:
        return False
    if layers == "all":
        return True
    n, k = out_features, in_features
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


def _amax(x: torch.Tensor, group) -> torch.Tensor:
    amax = x.detach().abs().max().float()
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _cast(ao, x: torch.Tensor, dtype: torch.dtype, mm_config, role, group):
    """x as a torchao float8 tensor (`ao`: compat's torchao_float8()) with one scale, from its amax over `group`
    (None: this rank's)."""
    scale = ao.amax_to_scale(_amax(x, group), dtype)
    return ao.to_float8(x, scale, dtype, mm_config, role)


class _Float8GradOutput(torch.autograd.Function):
    """Forward: nothing. Backward: the output gradient cast to `dtype` with one scale from its amax over `group`
    (torchao's NoopFwToFloat8BwDynamic, plus the reduction a sharded gradient needs). Traced by torch.compile into
    the layer's graph (not allow_in_graph: its arguments are not tensors), so the float8 gradient never crosses a
    graph boundary."""

    @staticmethod
    def forward(ctx, y, mm_config, dtype, group):
        ctx.mm_config, ctx.dtype, ctx.group = mm_config, dtype, group
        return y

    @staticmethod
    def backward(ctx, dy):
        if _AO.is_float8(dy):
            return dy, None, None, None
        return _cast(_AO, dy, ctx.dtype, ctx.mm_config, _AO.GemmInputRole.GRAD_OUTPUT, ctx.group), None, None, None


class Float8Linear:
    """The float8 GEMMs of one megatron-core linear (see the module docstring), for its `_forward_impl`."""

    def __init__(self, recipe: str, row_parallel: bool, emulate: bool, main_grad_fusion: bool, tp_group=None):
        global _AO
        # resolved once: torch.compile traces matmul() and cannot build the namespace inside a graph
        self.ao = ao = _AO = torchao_float8()
        self.recipe, self.row_parallel, self.main_grad_fusion = recipe, row_parallel, main_grad_fusion
        # The linear's own group (megatron-core passes none to the row-parallel function): the amax is reduced there
        self.group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        self.config = ao.Float8LinearConfig.from_recipe_name(recipe)
        c = self.config
        mm = [ao.ScaledMMConfig(emulate, g.use_fast_accum, False, c.pad_inner_dim)
              for g in (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)]
        self.mm_config = ao.LinearMMConfig(*mm)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.t() in float8; `x` is this rank's full GEMM input (after any sequence-parallel gather)."""
        ao, c = self.ao, self.config
        if self.recipe == "rowwise":  # torchao casts each operand per GEMM along its contraction axis
            return ao.matmul.apply(x, weight.t(), self.mm_config, c)
        group, role = self.group, ao.GemmInputRole
        w8 = _cast(ao, weight, c.cast_config_weight.target_dtype, self.mm_config, role.WEIGHT, group)
        # The column-parallel input is whole on every rank; the row-parallel input is cut along `in`.
        x8 = _cast(ao, x, c.cast_config_input.target_dtype, self.mm_config, role.INPUT,
                   group if self.row_parallel else None)
        y = ao.matmul.apply(x8, w8.t(), self.mm_config, c)
        # The column-parallel output gradient is cut along `out`; the row-parallel one is whole.
        return _Float8GradOutput.apply(y, self.mm_config, c.cast_config_grad_output.target_dtype,
                                       None if self.row_parallel else group)


@torch.library.custom_op("megatron_patch::add_into_main_grad", mutates_args=("main_grad",))
def add_into_main_grad(main_grad: torch.Tensor, grad: torch.Tensor) -> None:
    """main_grad += grad (in main_grad's precision)."""
    main_grad.add_(grad.to(main_grad.dtype))


@add_into_main_grad.register_fake
def _(main_grad, grad) -> None:
    return None


class _WeightGradIntoMainGrad(torch.autograd.Function):
    """Forward: the weight. Backward: its gradient added into megatron-core's gradient buffer (`main_grad`), none
    left in `.grad` (--gradient-accumulation-fusion with FP8: torch._scaled_mm cannot accumulate into its output)."""

    @staticmethod
    def forward(ctx, weight, main_grad):
        ctx.main_grad = main_grad  # not saved: a view of the flat buffer (see models/wgrad_fusion.py)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        add_into_main_grad(ctx.main_grad, grad)
        return None, None


def _make_forward_impl(fp8: Float8Linear):
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region)

    def forward_impl(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     gradient_accumulation_fusion: bool, allreduce_dgrad: bool, sequence_parallel: bool,
                     grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=None, gtp_remat_size: int = 1):
        # megatron-core's linear function's communication (layers.py:LinearWithGradAccumulationAndAsyncCommunication)
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        if (fp8.main_grad_fusion and torch.is_grad_enabled() and weight.requires_grad
                and getattr(weight, "main_grad", None) is not None):
            weight = _WeightGradIntoMainGrad.apply(weight, weight.main_grad)
        out = fp8.matmul(input, weight)
        return out + bias if bias is not None else out
    return forward_impl


def _candidates(chunks: Iterable[torch.nn.Module]) -> List[Tuple[str, torch.nn.Module]]:
    """(name, linear) of the column- and row-parallel linears of the transformer layers: not the output layer, not
    LoRA layers, not experts run as grouped GEMMs (they never call their linears)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    out = []
    for chunk in chunks:
        grouped = {id(m) for g in chunk.modules() if getattr(g, "grouped_gemm", False) for m in g.modules()}
        for name, m in chunk.named_modules():
            if (isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and "output_layer" not in name
                    and not hasattr(m, "lora_a") and id(m) not in grouped):
                out.append((name, m))
    return out


def apply_float8(chunks: Iterable[torch.nn.Module], recipe: str, layers: str = "auto",
                 main_grad_fusion: bool = False) -> str:
    """Route the eligible linears of `chunks` through torchao's float8 GEMMs (the module docstring's rule);
    returns the log line. Before --gradient-accumulation-fusion (which then leaves these linears alone) and
    --compile."""
    from megatron.core.tensor_parallel import RowParallelLinear

    if recipe not in RECIPES:
        raise ValueError(f"torchao's float8 recipes are {', '.join(RECIPES)}, not {recipe!r}")
    chunks = list(chunks)
    emulate = not fp8_gemms_available()
    converted, kept = 0, 0
    for _, m in _candidates(chunks):
        group = getattr(m, "tp_group", None)
        tp = group.size() if group is not None else 1
        local_out, local_in = m.weight.shape
        row = isinstance(m, RowParallelLinear)
        full_out, full_in = (local_out, local_in * tp) if row else (local_out * tp, local_in)
        if getattr(m, "explicit_expert_comm", False):  # an expert's shard shape is its own
            full_out, full_in = local_out, local_in
        if not keeps_fp8(recipe, full_out, full_in, local_out, local_in, layers):
            kept += 1
            continue
        fp8 = Float8Linear(recipe, row, emulate, main_grad_fusion, group)
        route_linears_through([m], lambda upstream, fp8=fp8: _make_forward_impl(fp8))
        m.fp8_linear = fp8  # read by --gradient-accumulation-fusion, which leaves this linear alone
        converted += 1
    how = "emulated in fp32 (no FP8 GPU)" if emulate else "torch._scaled_mm"
    kept_note = f", {kept} kept in high precision by the size rule (--fp8-layers)" if kept else ""
    return (f"FP8: {converted} linear layers run their GEMMs in float8 (torchao {recipe} recipe, "
            f"{FORMAT_OF_RECIPE[recipe]}, {how}){kept_note}; the output layer stays in high precision")
