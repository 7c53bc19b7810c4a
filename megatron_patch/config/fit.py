"""Will a run fit its GPUs? Model state (exact, memory_model.py) plus activations and the largest transient
(estimated, activation_memory.py) on the rank that holds the most, against a GPU's memory. The planner ranks
layouts by it; the engine warns with it before building a model that will not fit."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from .activation_memory import activation_bytes
from .memory_model import FSDP_UNIT_ELEMENTS, StateBytes, rank_position, rank_state_bytes

GiB = 2 ** 30
# a margin for what torch's caching allocator keeps beyond the live tensors (rounding to blocks, fragmentation): an
# assumed 5% of the peak, not measured (the planner's GPU check compares max_memory_allocated, without it)
ALLOCATOR_OVERHEAD = 0.05


@dataclass(frozen=True)
class RankMemory:
    """Predicted bytes on one rank."""
    rank: int
    state: StateBytes
    activations: int
    transient: int

    @property
    def peak(self) -> int:
        return self.state.total + self.activations + self.transient

    def as_dict(self) -> Dict[str, int]:
        return {**self.state.as_dict(), "activations": self.activations, "transient": self.transient,
                "peak": self.peak}


def rank_memory(cfg, vocab_size: int, world_size: int, rank: int) -> RankMemory:
    """Model state, activations and the largest transient of global rank `rank`."""
    state = rank_state_bytes(cfg, vocab_size, world_size, rank)
    act = activation_bytes(cfg, vocab_size, rank_position(cfg, world_size, rank).pp)
    transient = act.transient
    if cfg.zero_stage == 2 and world_size // (cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size) > 1:
        # Megatron-FSDP reduces gradients through full-size fp32 buckets of about FSDP_UNIT_ELEMENTS
        transient = max(transient, 2 * FSDP_UNIT_ELEMENTS * 4)
    return RankMemory(rank, state, act.kept, transient)


def peak_memory(cfg, vocab_size: int, world_size: int) -> RankMemory:
    """The rank with the highest predicted peak: the first and last rank of every pipeline stage are the
    candidates (stages differ in layers, embedding and logits; the last data-parallel rank in ZeRO padding)."""
    per_stage = world_size // cfg.pipeline_model_parallel_size
    ranks = sorted({s * per_stage + off for s in range(cfg.pipeline_model_parallel_size) for off in (0, per_stage - 1)})
    return max((rank_memory(cfg, vocab_size, world_size, r) for r in ranks), key=lambda m: m.peak)


def fit_warning(cfg, vocab_size: int, world_size: int, device_bytes: int) -> Optional[str]:
    """A sentence when the predicted peak (with the allocator's overhead) exceeds `device_bytes`, else None."""
    m = peak_memory(cfg, vocab_size, world_size)
    need = m.peak * (1 + ALLOCATOR_OVERHEAD)
    if need <= device_bytes:
        return None
    s = m.state
    return (f"warning: this run is predicted to need {need / GiB:.1f} GiB on rank {m.rank} (weights "
            f"{s.weights / GiB:.1f}, gradients {s.grads / GiB:.1f}, optimizer {s.optimizer / GiB:.1f}, activations "
            f"{m.activations / GiB:.1f}, largest transient {m.transient / GiB:.1f} GiB) but the GPU has "
            f"{device_bytes / GiB:.1f} GiB: it will likely run out of memory. Lower --micro-batch-size, add "
            f"--recompute-granularity full, raise --tensor/--pipeline-model-parallel-size or the ZeRO stage; "
            f"tools/plan_parallel.py ranks the layouts that fit.")
