"""`tools/plan_parallel.py`: the layouts of a model on N GPUs, fastest first, with their predicted memory."""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from typing import Callable, List, Optional

from megatron_patch.config import parse_args
from megatron_patch.config.errors import ConfigError
from megatron_patch.config.fit import GiB, peak_memory
from megatron_patch.config.memory_model import NotModelled, total_params
from megatron_patch.config.presets import FAMILIES, MOE_SIZES, SIZES
from megatron_patch.config.validate import resolve

from .hardware import GPUS, gpu
from .search import Plan, accepted, evaluate, plan

# the tokenizers' vocabularies of the released models (a --vocab-size overrides)
VOCAB = {"gpt": 50257, "llama": 32000, "llama3": 128256, "qwen2": 151936, "qwen3": 151936, "mistral": 32768,
         "mixtral": 32000, "qwen2_moe": 151936, "qwen3_moe": 151936}


def _model_flags(model: str) -> List[str]:
    """--model as engine flags: a Hugging Face model directory, or FAMILY-SIZE of the presets (llama3-8b)."""
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ConfigError(f"--model {model}: the directory has no config.json")
        return ["--load-hf", model]
    family, _, size = model.rpartition("-")
    if family not in FAMILIES or size not in {**SIZES.get(family, {}), **MOE_SIZES.get(family, {})}:
        known = ", ".join(f"{f}-{s}" for f in SIZES for s in SIZES[f] if s != "tiny")
        raise ConfigError(f"--model {model!r}: not a model directory nor a preset; presets: {known}")
    return ["--model-family", family, "--model-size", size]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plan_parallel.py", description=__doc__)
    p.add_argument("--model", help="FAMILY-SIZE of the presets (llama3-8b, llama3-70b, qwen3-8b, ...) or a Hugging "
                                   "Face model directory (its config.json)")
    p.add_argument("--engine-flags", help="plan the layout these engine flags give (run_gpt.sh --plan), instead "
                                          "of --model")
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the run")
    p.add_argument("--gpu", default="h100-80gb", choices=sorted(GPUS))
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--global-batch-size", type=int, default=None, help="default: 4 sequences per GPU")
    p.add_argument("--vocab-size", type=int, default=None, help="the tokenizer's vocabulary (default: the family's)")
    p.add_argument("--nodes", type=int, default=None, help="nodes of the run (default: GPUs / 8)")
    p.add_argument("--intra-node-bandwidth", type=float, default=None, help="GB/s per GPU within a node")
    p.add_argument("--inter-node-bandwidth", type=float, default=None, help="GB/s per GPU between nodes")
    p.add_argument("--micro-batch-size", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--zero-stages", type=int, nargs="+", default=[0, 1, 2], choices=[0, 1, 2])
    p.add_argument("--top", type=int, default=10)
    return p


def _row(i: int, p: Plan) -> str:
    c, m = p.cfg, p.memory
    vpp = c.virtual_pipeline_model_parallel_size or "-"
    ep = c.expert_model_parallel_size if c.num_experts else "-"
    return (f"{i:>3} | {c.tensor_model_parallel_size:>2} {c.pipeline_model_parallel_size:>3} {vpp:>3} "
            f"{c.data_parallel_size:>5} {ep:>3} {c.zero_stage:>4} {c.micro_batch_size:>3} "
            f"{(c.recompute_granularity or 'off'):>9} | {m.state.total / GiB:6.1f} {m.activations / GiB:6.1f} "
            f"{m.peak / GiB:6.1f} | {p.time.total:7.3f} {p.tokens_per_second / p.world_size:9,.0f} {100 * p.mfu:5.1f}%")


HEADER = ("  # | TP  PP VPP    DP  EP ZeRO mbs recompute |  state   acts   peak |  step s  tok/s/GPU   MFU\n"
          "    |                                          |   (GiB, busiest rank) |")


def _details(p: Plan) -> str:
    m, t = p.memory, p.time
    mem = ", ".join(f"{k} {v / GiB:.2f}" for k, v in m.as_dict().items())
    tm = ", ".join(f"{k} {v:.3f}" for k, v in t.as_dict().items())
    return f"  memory on rank {m.rank} (GiB): {mem}\n  step time (s): {tm}\n  flags: {p.flags()}"


def main(argv: Optional[List[str]] = None, parse: Callable = parse_args) -> int:
    """`parse`: engine flags -> Config; the command passes conversion.hf_source.parse_args, which also reads a
    Hugging Face directory's config.json (--model DIR), a layer above this package."""
    a = build_parser().parse_args(argv)
    g = gpu(a.gpu)
    if a.nodes:
        g = dataclasses.replace(g, gpus_per_node=max(a.gpus // a.nodes, 1))
    try:
        if a.engine_flags:
            flags = shlex.split(a.engine_flags)
        elif a.model:
            gbs = a.global_batch_size or 4 * a.gpus
            flags = [*_model_flags(a.model), "--seq-length", str(a.seq_length), "--global-batch-size", str(gbs),
                     "--bf16", "--mock-data", "--train-iters", "1"]
        else:
            raise ConfigError("give --model (or --engine-flags)")
        family = flags[flags.index("--model-family") + 1] if "--model-family" in flags else None
        vocab = a.vocab_size or VOCAB.get(family, 50257)
        if "--vocab-size" not in flags:
            flags += ["--vocab-size", str(vocab)]
        cfg = parse(flags)
        vocab = cfg.model_vocab_size or cfg.vocab_size or vocab
        print(f"model: {total_params(cfg, vocab) / 1e9:.2f}B parameters, {cfg.num_layers} layers, hidden "
              f"{cfg.hidden_size}, vocabulary {vocab} | {a.gpus} x {g.name} ({g.memory_bytes / GiB:.1f} GiB, "
              f"{g.gpus_per_node} per node) | sequence {cfg.seq_length}, global batch {cfg.global_batch_size}")
        if a.engine_flags:
            c = resolve(cfg, a.gpus)
            refusal = accepted(c, a.gpus)
            if refusal:
                print(f"the engine refuses this layout: {refusal}")
            p = evaluate(c, vocab, a.gpus, g, a.intra_node_bandwidth, a.inter_node_bandwidth)
            verdict = "fits" if p.fits else "does NOT fit"
            print(f"this run's layout {verdict}: peak {p.memory.peak / GiB:.1f} GiB on rank {p.memory.rank} of "
                  f"{g.memory_bytes / GiB:.1f}; step {p.time.total:.3f} s, MFU {100 * p.mfu:.1f}% (predicted)")
            print(_details(p))
            if not p.fits:
                better = plan(cfg, vocab, a.gpus, g, top=3, intra_gbps=a.intra_node_bandwidth,
                              inter_gbps=a.inter_node_bandwidth)
                if better:
                    print(f"layouts of {a.gpus} GPUs that fit, fastest first:\n{HEADER}")
                    for i, q in enumerate(better, 1):
                        print(_row(i, q))
                    print(f"  flags of the first: {better[0].flags()}")
            return 0
        plans = plan(cfg, vocab, a.gpus, g, top=a.top, intra_gbps=a.intra_node_bandwidth,
                     inter_gbps=a.inter_node_bandwidth, micro_batches=tuple(a.micro_batch_size),
                     zero_stages=tuple(a.zero_stages))
    except (ConfigError, NotModelled, ValueError) as e:
        print(f"plan_parallel.py: error: {e}", file=sys.stderr)
        return 2
    if not plans:
        smallest = peak_memory(resolve(cfg, a.gpus), vocab, a.gpus)
        print(f"no layout fits {a.gpus} x {g.name}: more GPUs, a larger GPU or a shorter sequence "
              f"(the default layout's busiest rank needs {smallest.peak / GiB:.1f} GiB)")
        return 1
    print(HEADER)
    for i, p in enumerate(plans, 1):
        print(_row(i, p))
    print(f"fastest:\n{_details(plans[0])}")
    print("memory: model state exact (the engine's buffers and optimizer shards); activations estimated. Step time: "
          "measured per-layer speed on one GPU, communication from bandwidth (a model, not a measurement).")
    return 0
