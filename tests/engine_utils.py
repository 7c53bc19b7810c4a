"""Run the pretraining entry point as users do (torchrun, several CPU processes with gloo) and read back
its per-iteration metrics and the full (unsharded) weights of its checkpoint.

Run as a script (by `run_counting_forwards`), this file trains like the entry point while counting the
forward calls of every transformer layer and core attention."""
from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
from typing import Dict, List

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ("--mock-data --vocab-size 128 --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 5 --lr 1e-4 --log-interval 1 --eval-interval 5 "
        "--eval-iters 2 --hidden-dropout 0 --attention-dropout 0 --init-layout-invariant --seed 7").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_engine(workdir, nproc: int, *args: str, base=TINY, check: bool = True, timeout: int = 900, script=None):
    """Run pretrain_megatron_gpt.py (or `script`: [path, its own arguments...]) under torchrun;
    returns (metrics lines, completed process)."""
    os.makedirs(workdir, exist_ok=True)
    metrics = os.path.join(str(workdir), "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), *(script or [os.path.join(ROOT, "pretrain_megatron_gpt.py")]), *base, *args, "--metrics-file", metrics]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(workdir), env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"engine failed ({proc.returncode}): {' '.join(args)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    lines = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
    return lines, proc


def train_losses(lines: List[dict]) -> List[float]:
    return [x["loss"] for x in lines if "loss" in x]


def per_iteration(lines: List[dict], key: str) -> List[float]:
    """`key` of every training iteration (validation records have no loss)."""
    return [x[key] for x in lines if "loss" in x]


def run_counting_forwards(workdir, *args: str, base=TINY):
    """Train on one process as run_engine does, but with step metrics deferred as on a GPU; returns (metrics lines,
    {"layer N" / "core_attention N": forward calls in training mode}), N the global layer number from 1. Evaluation runs in eval mode and
    is not counted, so without recomputation each count is iterations x micro batches."""
    counts = os.path.join(str(workdir), "forward_calls.json")
    lines, _ = run_engine(workdir, 1, *args, base=base, script=[os.path.abspath(__file__), "--count-forwards-to", counts])
    with open(counts) as f:
        return lines, json.load(f)


def _count_forwards_main(out: str, argv: List[str]) -> None:
    """The process behind run_counting_forwards: the engine's Trainer, with forward hooks that count calls, and
    its step metrics deferred as on a GPU (a step's metrics read once the next step is queued).

    Hooks observe the real model; nothing in the training step is replaced."""
    import torch.distributed as dist
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_patch.config import parse_args
    from megatron_patch.parallel import destroy
    from megatron_patch.training.loop import Trainer

    counts = collections.Counter()

    def counter(key):
        def hook(module, inputs, output):
            if module.training:
                counts[key] += 1
        return hook

    try:
        trainer = Trainer(parse_args(argv))
        trainer.defer_step_metrics = True  # as on a GPU: each step's metrics read once the next step is queued
        for chunk in trainer.model:
            for m in chunk.modules():
                if isinstance(m, TransformerLayer):
                    m.register_forward_hook(counter(f"layer {m.layer_number}"))
                    m.self_attention.core_attention.register_forward_hook(counter(f"core_attention {m.layer_number}"))
        trainer.train()
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(counts, f)
    finally:
        destroy()


def full_weights(checkpoint: str) -> Dict[str, torch.Tensor]:
    """Model tensors of a dist_checkpointing (torch_dist) checkpoint, unsharded, keyed by global name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = checkpoint.rstrip("/") + ".pt"
    if not os.path.exists(out):
        dcp_to_torch_save(checkpoint, out)
    state = torch.load(out, weights_only=False)
    if json.load(open(os.path.join(checkpoint, "checkpoint.json")))["format"] != "fsdp_dtensor":
        return {k: v for k, v in state.items() if torch.is_tensor(v) and not k.startswith("optimizer.")}
    # ZeRO-2 (torch DCP of DTensors): "model.decoder.layers.<global i>.<name>" -> stacked "decoder.layers.<name>"
    import re

    flat, layers = {}, {}
    model = state["model"] if isinstance(state.get("model"), dict) else \
        {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    for k, v in model.items():
        if not torch.is_tensor(v):
            continue
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", k)
        if m:
            # dist_checkpointing names the local spec's norms as Transformer Engine's fused ones
            name = re.sub(r"^input_layernorm\.(\w+)$", r"self_attention.linear_qkv.layer_norm_\1", m.group(2))
            name = re.sub(r"^pre_mlp_layernorm\.(\w+)$", r"mlp.linear_fc1.layer_norm_\1", name)
            layers.setdefault(name, {})[int(m.group(1))] = v
        else:
            flat[k] = v
    for name, per_layer in layers.items():
        flat[f"decoder.layers.{name}"] = torch.stack([per_layer[i] for i in sorted(per_layer)])
    # With PP the last stage holds a copy of a tied embedding; it must have stayed equal to it.
    out, emb = flat.get("output_layer.weight"), flat.get("embedding.word_embeddings.weight")
    if out is not None and emb is not None and torch.allclose(out, emb, rtol=0, atol=1e-6):
        del flat["output_layer.weight"]
    return flat


if __name__ == "__main__":  # run_counting_forwards: engine_utils.py --count-forwards-to FILE <engine flags>
    sys.path.insert(0, ROOT)  # the engine of this tree, as pretrain_megatron_gpt.py would import it
    _count_forwards_main(sys.argv[2], sys.argv[3:])
