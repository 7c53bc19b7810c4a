"""The layouts of a model on N GPUs: every TP/PP/VPP/DP/EP/ZeRO/micro-batch/recompute combination the engine
accepts (its own configuration checks decide), with predicted memory and step time, fastest first."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional

from megatron_patch.config.checks import run_checks
from megatron_patch.config.errors import ConfigError
from megatron_patch.config.fit import ALLOCATOR_OVERHEAD, RankMemory, peak_memory
from megatron_patch.config.validate import resolve

from .hardware import Gpu
from .timing import StepTime, mfu, step_time

CHECKED = ("layout", "moe", "model", "batch", "memory", "precision")
RECOMPUTE = (None, "selective", "full")


@dataclass(frozen=True)
class Plan:
    cfg: object  # the resolved Config of the layout
    world_size: int
    memory: RankMemory  # the rank with the highest predicted peak
    time: StepTime
    mfu: float
    fits: bool

    @property
    def tokens_per_second(self) -> float:
        return self.cfg.global_batch_size * self.cfg.seq_length / self.time.total

    def flags(self) -> str:
        """The engine flags of this layout."""
        c = self.cfg
        out = [f"--tensor-model-parallel-size {c.tensor_model_parallel_size}",
               f"--pipeline-model-parallel-size {c.pipeline_model_parallel_size}"]
        if c.num_layers_per_virtual_pipeline_stage:
            out.append(f"--num-layers-per-virtual-pipeline-stage {c.num_layers_per_virtual_pipeline_stage}")
        if c.sequence_parallel:
            out.append("--sequence-parallel")
        if c.num_experts and c.expert_model_parallel_size > 1:
            out.append(f"--expert-model-parallel-size {c.expert_model_parallel_size}")
        if c.zero_stage:
            out.append(f"--zero-{c.zero_stage}-memory-optimization")
        out.append(f"--micro-batch-size {c.micro_batch_size}")
        if c.recompute_granularity:
            out.append(f"--recompute-granularity {c.recompute_granularity}")
        return " ".join(out)


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(cfg, world_size: int, g: Gpu, micro_batches=(1, 2, 4, 8), zero_stages=(0, 1, 2),
            recompute=RECOMPUTE) -> Iterator[object]:
    """Every candidate Config (unchecked) for `world_size` GPUs."""
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
    for tp in (t for t in (1, 2, 4, 8) if t <= g.gpus_per_node and world_size % t == 0):
        if heads % tp or groups % tp:
            continue
        for pp in (p for p in _divisors(cfg.num_layers) if world_size % (tp * p) == 0):
            dp = world_size // (tp * pp)
            per_stage = cfg.num_layers // pp
            chunks = [None] + ([c for c in _divisors(per_stage) if c < per_stage and per_stage // c <= 16] if pp > 1 else [])
            eps = [1]
            if cfg.num_experts:
                eps = [e for e in _divisors(cfg.num_experts) if (tp * dp) % e == 0]
            for chunk in chunks:
                for ep in eps:
                    for zero in zero_stages:
                        if zero == 2 and chunk is not None:
                            continue
                        for mbs in micro_batches:
                            if cfg.global_batch_size % (mbs * dp):
                                continue
                            for rc in recompute:
                                yield cfg.replace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                  num_layers_per_virtual_pipeline_stage=chunk, sequence_parallel=tp > 1,
                                                  expert_model_parallel_size=ep, expert_tensor_parallel_size=None,
                                                  zero_stage=zero, micro_batch_size=mbs, recompute_granularity=rc,
                                                  checkpoint_activations=False)


def accepted(cfg, world_size: int) -> Optional[str]:
    """None when the engine's checks accept the layout, else their refusal."""
    try:
        run_checks(cfg, concerns=CHECKED)
    except ConfigError as e:
        return str(e)
    return None


def evaluate(cfg, vocab_size: int, world_size: int, g: Gpu, intra_gbps=None, inter_gbps=None) -> Plan:
    """The plan of one layout (`cfg` resolved for `world_size`)."""
    mem = peak_memory(cfg, vocab_size, world_size)
    t = step_time(cfg, vocab_size, world_size, g, intra_gbps, inter_gbps)
    return Plan(cfg, world_size, mem, t, mfu(cfg, vocab_size, world_size, g, t.total),
                mem.peak * (1 + ALLOCATOR_OVERHEAD) <= g.memory_bytes)


def plan(cfg, vocab_size: int, world_size: int, g: Gpu, top: int = 10, intra_gbps=None, inter_gbps=None,
         **space) -> List[Plan]:
    """The `top` fastest layouts that fit and that the engine accepts."""
    ranked = []
    for c in layouts(cfg, world_size, g, **space):
        c = resolve(c, world_size)
        p = evaluate(c, vocab_size, world_size, g, intra_gbps, inter_gbps)
        if p.fits:
            ranked.append(p)
    ranked.sort(key=lambda p: p.time.total)
    out = []
    for p in ranked:
        if accepted(p.cfg, world_size) is None:
            out.append(p)
            if len(out) == top:
                break
    return out


