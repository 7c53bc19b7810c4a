"""Backend for ZeRO-2 runs (Megatron-FSDP): its DTensor state through torch.distributed.checkpoint.

Megatron-FSDP shards parameters, gradients and optimizer state unevenly over data-parallel ranks;
the checkpoint holds those DTensors (global shapes: each is Shard(tp_dim) over TP, then the uneven DP shard)
under names with *global* layer numbers (each pipeline stage numbers its layers from 0), plus one RNG file
per (PP, TP) rank. DCP reshards them to any DP, TP and PP.

One tensor does not split along TP as a whole: SwiGLU's fc1 is [gate; up] on every TP rank, so its TP-global
tensor interleaves the ranks' halves ([g0; u0; g1; u1] at TP 2). Checkpoints marked fully reshardable (the
manifest's `optimizer_sharding`, written since this was fixed) store it as megatron-core's own two keys
`linear_fc1.weight_w` / `_v` (gate, up; megatron-core's handle_swiglu_in_state_dict, Megatron-LM's keys),
each TP-global. Older ZeRO-2 checkpoints hold the interleaved tensor and load at their own TP/PP only.

With tied embeddings and PP > 1 the last stage holds a copy of the word embedding (`output_layer.weight`),
which a checkpoint of one pipeline stage does not have: it loads from the embedding (and its Adam state, equal,
since both copies get the same summed gradient).
"""
from __future__ import annotations

import os
import re
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import parallel_state as mpu
from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_swiglu_in_state_dict

from megatron_patch.compat.adam_state import fill_empty_adam_state, steps_on_param_device
from megatron_patch.compat.megatron_fsdp import (
    copy_main_to_model_params, prepare_uneven_dtensor_state, use_distributed_params,
)

from . import rng
# the manifest's optimizer_sharding value, shared with ZeRO-1's format: here it means SwiGLU fc1 stored split
from .torch_dist import FULLY_RESHARDABLE, unwrap

FORMAT = "fsdp_dtensor"
OPT_METADATA = {"distrib_optim_sharding_type": "fsdp_dtensor"}
TIED_COPY, EMBEDDING = "output_layer.weight", "embedding.word_embeddings.weight"


def _global_layer_names(chunk) -> Callable[[str], str]:
    model = unwrap(chunk)
    stack = "decoder" if hasattr(model, "decoder") else "encoder"  # GPTModel's layers, BertModel's
    layers = getattr(model, stack).layers
    offsets = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
    pattern = re.compile(rf"{stack}\.layers\.(\d+)\.")
    return lambda name: pattern.sub(lambda m: f"{stack}.layers.{offsets[int(m.group(1))]}.", name, count=1)


def _rename_param_keys(optimizer_state: Dict, rename: Callable[[str], str]) -> Dict:
    """The fsdp_dtensor optimizer dict keys its per-parameter entries by parameter name."""
    return {k: ({rename(n): x for n, x in v.items()} if k in ("state", "param_to_group_meta") else v)
            for k, v in optimizer_state.items()}


def _state(model: List, optimizer, is_loading: bool, split_swiglu: bool = True,
           stored: Optional[Set[str]] = None) -> Tuple[Dict, Dict, Dict]:
    """(the DCP state of this rank with global names, the model's state dict, the optimizer's), the last two with
    this rank's names and sharing their tensors with the first. `split_swiglu`: fc1 as its two TP-global halves
    (views of the shards). `stored`: the keys of the checkpoint being loaded (for a tied copy it lacks)."""
    use_distributed_params(model)
    fill_empty_adam_state(optimizer)  # ranks with an empty shard must still describe the same keys
    rename = _global_layer_names(model[0])
    own_opt = optimizer.sharded_state_dict({}, is_loading=is_loading, metadata=OPT_METADATA)
    own_weights = unwrap(model[0]).state_dict()
    weights, opt = own_weights, own_opt
    if split_swiglu and unwrap(model[0]).config.gated_linear_unit:
        weights, opt = _split_swiglu(model[0], weights, opt)
    state = {"model": {rename(k): v for k, v in weights.items()}, "optimizer": _rename_param_keys(opt, rename)}
    if stored is not None and TIED_COPY in state["model"] and f"model.{TIED_COPY}" not in stored:
        state = _tied_copy_from_embedding(state)
    return prepare_uneven_dtensor_state(state), own_weights, own_opt


def _split_swiglu(chunk, weights: Dict, opt: Dict) -> Tuple[Dict, Dict]:
    """megatron-core's handle_swiglu_in_state_dict on this chunk's dicts. It looks the model's names up as
    `module.<name>` from the wrapper right around the model, and the optimizer's, with one `module.` prefix
    dropped, from the model itself: ours carry one prefix per wrapper (FullyShardedDataParallel, MegatronFSDP, with
    bf16 Float16Module), so they are renamed and back. It runs collectives per parameter in the dicts' order, which
    for the optimizer's differs between ranks (the state fill_empty_adam_state added comes last): sorted."""
    inner = chunk
    while hasattr(inner.module, "module"):
        inner = inner.module
    weights, _ = handle_swiglu_in_state_dict(inner, weights, None)
    prefix = re.match(r"^(module\.)*", next(iter(opt["state"]), "")).group(0)
    short = lambda n: "module." + n[len(prefix):] if n.startswith(prefix) else n  # noqa: E731
    full = lambda n: prefix + n[len("module."):] if n.startswith("module.") else n  # noqa: E731
    opt = _rename_param_keys({**opt, "state": dict(sorted(opt["state"].items()))}, short)
    _, opt = handle_swiglu_in_state_dict(unwrap(chunk), {}, opt)
    return weights, _rename_param_keys(opt, full)


def _tied_copy_from_embedding(state: Dict) -> Dict:
    """Load the last stage's tied copy of the word embedding (and its optimizer entries) from the embedding's keys."""
    swap = lambda n: n.replace(TIED_COPY, EMBEDDING) if n.endswith(TIED_COPY) else n  # noqa: E731
    return {"model": {swap(k): v for k, v in state["model"].items()},
            "optimizer": _rename_param_keys(state["optimizer"], swap)}


def _rng_file(path: str) -> str:
    k = rng.layout_key()
    return os.path.join(path, f"rng_pp{k['pp']}_tp{k['tp']}.pt")


def save(path: str, model: List, optimizer, consume_model: bool = False,
         optim_sharding: Optional[str] = FULLY_RESHARDABLE) -> None:
    # consume_model is a torch_dist matter (views of fc1); DTensor shards own their storage
    state, _, _ = _state(model, optimizer, is_loading=False, split_swiglu=optim_sharding == FULLY_RESHARDABLE)
    dcp.save(state, checkpoint_id=path)
    if mpu.get_data_parallel_rank() == 0:
        torch.save(rng.capture(), _rng_file(path))


def load(path: str, model: List, optimizer, load_optimizer: bool, load_rng: bool, without_adapters: bool = False,
         optim_sharding: Optional[str] = None) -> None:
    """Load checkpoint `path` into this run, at its own layout or (fully reshardable) another TP/PP/DP."""
    stored = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    state, own_weights, own_opt = _state(model, optimizer, is_loading=True,
                                         split_swiglu=optim_sharding == FULLY_RESHARDABLE, stored=stored)
    if not load_optimizer:
        del state["optimizer"]
    # DCP loads in place: into the shards themselves or views of them (split fc1), and into the per-parameter
    # dicts that `state` shares with the module's and the optimizer's own state dicts, loaded below
    dcp.load(state, checkpoint_id=path)
    unwrap(model[0]).load_state_dict(own_weights)
    # The module's parameters are the fp32 main-weight shards; with bf16 the compute weights are a
    # separate copy that only an optimizer step refreshes: refresh it now, and gather it across DP.
    copy_main_to_model_params(optimizer)
    for chunk in model:
        if hasattr(chunk, "start_param_sync"):
            chunk.start_param_sync(force_sync=True)
    if load_optimizer:
        for w in getattr(optimizer, "chained_optimizers", [optimizer]):
            w.load_state_dict(own_opt)
        steps_on_param_device(optimizer)
    if load_rng:
        rng.restore(torch.load(_rng_file(path), weights_only=True))
    dist.barrier()
