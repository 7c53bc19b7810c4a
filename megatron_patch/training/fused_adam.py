"""`--optimizer-step-fusion`: the bf16 run's Adam/AdamW step in one Triton kernel launch per param group.

megatron-core's mixed-precision optimizer (Float16OptimizerWithFloat16Params) steps in several passes over every
parameter: an fp32 copy of each bf16 gradient (`main_grad.float()`), the gradient norm over those copies, clipping
(a multiply of each copy, in place), torch's fused AdamW (reads the fp32 weight, gradient and both moments,
writes weight and moments), then a copy of each fp32 main weight into its bf16 model weight. That is about
54 bytes of memory traffic per parameter with bf16 gradients; for a 1.3B model some 70 GB a step, all of it
memory-bound. Here the gradient norm reads the gradient buffer itself (megatron-core's own norm function, fp32
accumulation), clipping becomes a factor the kernel applies as it loads the gradient, and the kernel reads
gradient, fp32 weight and moments once and writes fp32 weight, moments and the bf16 model weight: about 32
bytes per parameter, and no fp32 gradient copies in memory (5.4 GB for 1.3B parameters). One launch covers every
tensor of a param group (a table of their addresses, built once and reused while they stay put): with one launch
per tensor, a small model's step was bound by the host's ~150 launches, not by memory. Measured on an H100
(benchmarks/RESULTS.md): Llama 1.3B +1.4% tokens/s, GPT-2 124M +1.0% (one launch per tensor: +0.7-0.9%, -0.2%).

The update is torch's Adam/AdamW formula (non-amsgrad, not maximize), in fp32 like torch's fused kernel, with the
per-parameter state torch keeps (`step`, `exp_avg`, `exp_avg_sq`), so checkpoints are interchangeable with runs
without the switch. Bias corrections 1 - beta**step are computed in float64 on the device from the group's step
(every parameter of a group steps together: megatron-core gives each a gradient every step, the buffer), so nothing
waits on the host. The fp32 -> bf16 rounding of the model weight is done by hand to nearest even (Triton's
interpreter truncates), which is what torch's `copy_` does. TRITON_INTERPRET=1 runs the kernel in Triton's
interpreter on the CPU (tests); the kernel is decorated on first use (models/triton_jit.py).
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch

from megatron_patch.models.triton_jit import jit

try:  # the kernel's language; the wheel comes with torch's CUDA builds (validate() checks before a run)
    import triton.language as tl
except ImportError:  # pragma: no cover
    tl = None

BLOCK = 2048  # elements per program; a memory-bound elementwise kernel, 8 warps


def _adam_kernel(table_ptr, block_tensor_ptr, corr_ptr, coef_ptr, lr, beta1, beta2, eps, weight_decay,
                 GRAD: tl.constexpr, MODEL: tl.constexpr, MOMENT: tl.constexpr, MOMENT_SQ: tl.constexpr,
                 ALIGNED: tl.constexpr, DECOUPLED: tl.constexpr, BLOCK: tl.constexpr):
    """One block of one of many tensors (one launch for all of them): the program's tensor is
    block_tensor[program_id], whose row of `table` holds its pointers, size and first block. g = grad * coef;
    torch's Adam(W) update of main/exp_avg/exp_avg_sq in fp32; the new weight rounded into the model's bf16/fp16
    tensor when there is one. The moments are kept in MOMENT / MOMENT_SQ (fp32, or bf16: computed in fp32, rounded to
    nearest even when stored). corr = [1 - beta1**t, 1 - beta2**t]. ALIGNED: every pointer 16-byte aligned and
    every size a multiple of 16 (the host checked), which lets the compiler use 16-byte loads and stores."""
    pid = tl.program_id(0)
    # a row: main, grad, exp_avg, exp_avg_sq, model pointers, numel, first block
    row = table_ptr + tl.load(block_tensor_ptr + pid).to(tl.int64) * 7
    main_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
    grad_ptr = tl.load(row + 1).to(tl.pointer_type(GRAD))
    exp_avg_ptr = tl.load(row + 2).to(tl.pointer_type(MOMENT))
    exp_avg_sq_ptr = tl.load(row + 3).to(tl.pointer_type(MOMENT_SQ))
    model_ptr = tl.load(row + 4).to(tl.pointer_type(MODEL))
    n = tl.load(row + 5)
    offs = (pid - tl.load(row + 6)) * BLOCK + tl.arange(0, BLOCK)
    if ALIGNED:
        main_ptr = tl.multiple_of(main_ptr, 16)
        grad_ptr = tl.multiple_of(grad_ptr, 16)
        exp_avg_ptr = tl.multiple_of(exp_avg_ptr, 16)
        exp_avg_sq_ptr = tl.multiple_of(exp_avg_sq_ptr, 16)
        model_ptr = tl.multiple_of(model_ptr, 16)
        n = tl.multiple_of(n, 16)
        offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
    mask = offs < n
    bc1 = tl.load(corr_ptr).to(tl.float32)
    bc2 = tl.load(corr_ptr + 1).to(tl.float32)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(coef_ptr)
    p = tl.load(main_ptr + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if DECOUPLED:  # AdamW
        p = p - lr * weight_decay * p
    else:  # Adam: L2 penalty in the gradient
        g = g + weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / tl.sqrt(bc2) + eps
    p = p - (lr / bc1) * m / denom
    tl.store(main_ptr + offs, p, mask=mask)
    if MOMENT == tl.bfloat16:  # (the interpreter's cast truncates: rounded by hand, as below)
        m_bits = m.to(tl.uint32, bitcast=True)
        m_bits = m_bits + 0x7FFF + ((m_bits >> 16) & 1)
        tl.store(exp_avg_ptr + offs, (m_bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(exp_avg_ptr + offs, m, mask=mask)
    if MOMENT_SQ == tl.bfloat16:
        v_bits = v.to(tl.uint32, bitcast=True)
        v_bits = v_bits + 0x7FFF + ((v_bits >> 16) & 1)
        tl.store(exp_avg_sq_ptr + offs, (v_bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    if MODEL == tl.bfloat16:  # round to nearest even by hand (the interpreter's cast truncates)
        bits = p.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        tl.store(model_ptr + offs, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    elif MODEL != tl.float32:  # fp16 (a float32 MODEL means: no model tensor)
        tl.store(model_ptr + offs, p.to(MODEL), mask=mask)


# (device, beta1, beta2) -> tensor([beta1, beta2], float64) there. Made once: torch.tensor(..., device="cuda") copies
# from pageable host memory and so waits for the GPU, which every step would then do.
_BETAS: Dict[tuple, torch.Tensor] = {}


def bias_corrections(step: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """[1 - beta1**step, 1 - beta2**step] in float64 on the step's device (no host read of the step, no copy)."""
    key = (step.device, float(beta1), float(beta2))
    if key not in _BETAS:
        _BETAS[key] = torch.tensor([beta1, beta2], dtype=torch.float64, device=step.device)
    return 1.0 - _BETAS[key].pow(step.to(torch.float64))


class LaunchTable:
    """The device tables of one multi-tensor launch: a row of pointers, size and first block per tensor, and the
    tensor of every block. Built from the tensors' addresses, and reused while they stay the same (so the
    host-to-device copy, which waits for the GPU, happens once, not every step)."""

    def __init__(self, tensors: List[Tuple[torch.Tensor, ...]]) -> None:
        self.key = self.key_of(tensors)
        rows, owners = [], []  # the table's rows are the key's addresses and sizes, plus each tensor's first block
        for i, (main, grad, exp_avg, exp_avg_sq, model, n) in enumerate(self.key):
            rows.append([main, grad, exp_avg, exp_avg_sq, main if model is None else model, n, len(owners)])
            owners.extend([i] * _cdiv(n, BLOCK))
        self.blocks = len(owners)
        self.aligned = all(all(x % 16 == 0 for x in r[:6]) for r in rows)  # pointers, and sizes (x elements)
        device = tensors[0][0].device
        self.table = torch.tensor(rows, dtype=torch.int64).to(device)
        self.block_tensor = torch.tensor(owners, dtype=torch.int32).to(device)

    @staticmethod
    def key_of(tensors: List[Tuple[torch.Tensor, ...]]) -> tuple:
        return tuple((m.data_ptr(), g.data_ptr(), a.data_ptr(), s.data_ptr(), None if t is None else t.data_ptr(),
                      m.numel()) for m, g, a, s, t in tensors)


def _check(main: torch.Tensor, others: Tuple[Optional[torch.Tensor], ...]) -> None:
    n = main.numel()
    for t in (main,) + others:
        if t is not None and (t.numel() != n or not t.is_contiguous()):
            raise ValueError(f"fused Adam: tensors must be contiguous with {n} elements, got {tuple(t.shape)} "
                             f"strides {t.stride()}")


def adam_update_(tensors: List[Tuple[torch.Tensor, ...]], corrections: torch.Tensor, coef: torch.Tensor, *,
                 lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
                 table: Optional[LaunchTable] = None) -> LaunchTable:
    """One Adam(W) step of many tensors in place, in one launch: `tensors` are (main, grad, exp_avg, exp_avg_sq,
    model) with main fp32, each moment fp32 or bf16 (one dtype for all), grad of one float dtype for all (scaled by the one-element fp32 `coef`:
    gradient clipping), model None for all or of one dtype for all (it receives the new weight). All contiguous,
    each tuple's of one size; `corrections` from bias_corrections(). Returns the launch table; pass it back as
    `table` to skip rebuilding it when the tensors are the same."""
    tensors = [t for t in tensors if t[0].numel()]
    if not tensors:
        return table
    for main, *others in tensors:
        _check(main, tuple(others))
    if table is None or table.key != LaunchTable.key_of(tensors):
        table = LaunchTable(tensors)
    grad, exp_avg, exp_avg_sq, model = tensors[0][1:]
    main = tensors[0][0]
    ctx = torch.cuda.device(main.device) if main.is_cuda else contextlib.nullcontext()
    with ctx:
        jit(_adam_kernel)[(table.blocks,)](
            table.table, table.block_tensor, corrections, coef, float(lr), float(beta1), float(beta2), float(eps),
            float(weight_decay), GRAD=_TL[grad.dtype], MODEL=_TL[torch.float32 if model is None else model.dtype],
            MOMENT=_TL[exp_avg.dtype], MOMENT_SQ=_TL[exp_avg_sq.dtype], ALIGNED=table.aligned, DECOUPLED=decoupled, BLOCK=BLOCK, num_warps=8)
    return table


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16} if tl else {}


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _state(optimizer: torch.optim.Optimizer, p: torch.Tensor, moments=(torch.float32, torch.float32)) -> dict:
    """torch's Adam state of `p`, created as torch creates it for a fused group when missing (megatron-core's
    init_state_fn makes the moments without `step`), its moments in `moments` (exp_avg's and exp_avg_sq's dtypes:
    --exp-avg-dtype, --exp-avg-sq-dtype; fp32 moments loaded from a checkpoint are converted once)."""
    st = optimizer.state[p]
    if "step" not in st:
        st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
    elif st["step"].device != p.device:  # loaded into a group torch did not know as fused: left on the CPU
        st["step"] = st["step"].to(p.device)
    for key, dtype in zip(("exp_avg", "exp_avg_sq"), moments):
        if key not in st:
            st[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        elif st[key].dtype != dtype:
            st[key] = st[key].to(dtype)
    return st


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError unless `optimizer` is a torch Adam/AdamW this kernel reproduces."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(f"--optimizer-step-fusion runs Adam/AdamW; this run's optimizer is {type(optimizer).__name__}")
    for g in optimizer.param_groups:
        for key in ("amsgrad", "maximize", "differentiable"):
            if g.get(key):
                raise ValueError(f"--optimizer-step-fusion does not implement Adam's {key}=True")
        if torch.is_tensor(g["lr"]):
            raise ValueError("--optimizer-step-fusion needs a float learning rate, not a tensor")


def step_adam(optimizer: torch.optim.Optimizer, models: Dict[int, torch.Tensor], coef: Optional[torch.Tensor],
              moments=(torch.float32, torch.float32)) -> None:
    """One step of every parameter of torch Adam/AdamW `optimizer` whose `.grad` is set, by the kernel: one launch
    per param group (and per gradient/model dtype in it). `models` maps id(main parameter) -> the model tensor that
    receives its new value; `coef` is the clipping factor (a one-element tensor or None for 1); `moments` the
    dtypes of exp_avg and exp_avg_sq."""
    decoupled_default = isinstance(optimizer, torch.optim.AdamW)  # torch >= 2.6 also says so in each group
    tables = optimizer.__dict__.setdefault("_fused_adam_tables", {})  # (group, dtypes) -> LaunchTable
    for index, group in enumerate(optimizer.param_groups):
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        states = [_state(optimizer, p, moments) for p in params]
        steps: List[torch.Tensor] = [st["step"] for st in states]
        torch._foreach_add_(steps, 1)
        beta1, beta2 = group["betas"]
        corrections = bias_corrections(steps[0], beta1, beta2)
        decoupled = bool(group.get("decoupled_weight_decay", decoupled_default))
        if coef is None:
            coef = torch.ones(1, dtype=torch.float32, device=params[0].device)  # a fill kernel, no copy
        coef = coef.to(device=params[0].device, dtype=torch.float32).reshape(1)  # already there on the GPU path
        launches: Dict[tuple, list] = {}
        for p, st in zip(params, states):
            model = models.get(id(p))
            model = None if model is None else model.data
            kind = (p.grad.dtype, None if model is None else model.dtype)
            launches.setdefault(kind, []).append((p.data, p.grad, st["exp_avg"], st["exp_avg_sq"], model))
        for kind, tensors in launches.items():
            tables[(index, kind)] = adam_update_(
                tensors, corrections, coef, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"], decoupled=decoupled, table=tables.get((index, kind)))


MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def apply_optimizer_step_fusion(optimizer, exp_avg_dtype: str = "fp32", exp_avg_sq_dtype: str = "fp32") -> str:
    """Make every megatron-core mixed-precision wrapper in `optimizer` step with the kernel (see the module's
    docstring), its moments kept in the given dtypes ("fp32" or "bf16"); returns a log line."""
    import functools

    from megatron_patch.compat.optimizer import fuse_optimizer_step

    moments = (MOMENT_DTYPES[exp_avg_dtype], MOMENT_DTYPES[exp_avg_sq_dtype])
    count, numel = fuse_optimizer_step(optimizer, functools.partial(step_adam, moments=moments), check_optimizer)
    kept = "" if moments == (torch.float32, torch.float32) else (
        f", moments in {exp_avg_dtype}/{exp_avg_sq_dtype} ({sum(d.itemsize for d in moments)} bytes per parameter "
        f"instead of 8)")
    return (f"optimizer step fusion: Adam in one Triton kernel launch per param group ({count} tensors, "
            f"{numel / 1e6:.1f}M parameters), gradients read from the gradient buffer, clipping applied in the "
            f"kernel{kept}")
