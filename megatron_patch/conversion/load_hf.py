"""`--load-hf DIR`: Hugging Face weights loaded straight into this rank's model chunks, whatever the
TP/PP/VPP layout, with no intermediate files. Each parameter is built in full by the family's table
(one tensor at a time, read from the safetensors shard that holds it) and cut to this rank's slice.

Coverage is checked, not assumed: every parameter starts as NaN and must be written; every Hugging
Face tensor must be used by some rule (or be a known buffer); and across all ranks every rule of the
table must have found its parameter. Optional parts of the model that the checkpoint lacks entirely
(BERT's MLM/NSP heads in a bare `BertModel`) are initialised instead, layout-invariantly, and reported;
tensors of optional parts the model does not build are dropped and reported."""
from __future__ import annotations

import math
from typing import Callable, Dict, Iterable, List, Tuple

import torch
import torch.distributed as dist

from megatron_patch.models.gpt import padded_vocab_size
from megatron_patch.models.init import initial_tensor
from megatron_patch.models.partition import global_name, global_shape, local_shard

from . import tables
from .family import Family
from .hf_io import HFCheckpointReader, read_hf_config
from .mapping import ConversionError, absent_parts, check_coverage, dims, options, to_mcore


def hf_reader(hf_dir: str, family: Family) -> Tuple[List[str], Callable[[str], torch.Tensor]]:
    """(names, read) for a Hugging Face directory, with the family's optional name prefix restored."""
    reader = HFCheckpointReader(hf_dir)
    names = list(reader.keys())
    prefix = family.hf_prefix
    if prefix and names and not any(n.startswith(prefix) for n in names):
        return [prefix + n for n in names], lambda n: reader.get(n[len(prefix):] if n.startswith(prefix) else n)
    return names, reader.get


@torch.no_grad()
def load_global_weights(chunks: List[torch.nn.Module], cfg, get: Callable[[str], torch.Tensor], expected: Iterable[str],
                        where: str, initialise: Iterable[str] = ()) -> int:
    """Fill every parameter of this rank's unwrapped GPTModel/BertModel `chunks` with its slice of the global
    tensor `get(global name)`, or for names in `initialise` of models.init.initial_tensor (seeded by the name:
    the same in every layout); every name in `expected` must land in some rank's parameter. Collective."""
    initialise = set(initialise)
    expected = set(expected) | initialise
    applied = set()
    for chunk in chunks:
        params = list(chunk.named_parameters())
        for _, p in params:
            p.fill_(math.nan)
        for name, p in params:
            gname = global_name(name, chunk)
            if gname not in expected:
                raise ConversionError(f"the model's parameter {gname} is not in {where}: the engine built a part "
                                      f"this checkpoint does not have")
            full = initial_tensor(gname, global_shape(p, gname), cfg.seed, cfg.init_method_std) \
                if gname in initialise else get(gname)
            shard = local_shard(full, p, gname, cfg.swiglu)
            if shard.shape != p.shape:
                raise ConversionError(f"{where} gives {gname} the shape {tuple(shard.shape)} on this rank, the model "
                                      f"has {tuple(p.shape)}: the configuration and the weights disagree")
            p.copy_(shard)
            applied.add(gname)
        unfilled = [n for n, p in params if torch.isnan(p).any()]
        if unfilled:
            raise ConversionError(f"parameters left unfilled by {where}: {', '.join(unfilled[:3])}")
    everywhere = [None] * dist.get_world_size()
    dist.all_gather_object(everywhere, sorted(applied))
    missed = sorted(expected - set().union(*map(set, everywhere)))
    if missed:
        raise ConversionError(f"no parameter of the model took {', '.join(missed[:3])} from {where}: the engine's "
                              f"model lacks a part of that checkpoint")
    return len(applied)


def load_hf_weights(chunks: List[torch.nn.Module], cfg, hf_dir: str) -> Dict:
    """Fill the unwrapped model `chunks` of this rank from the Hugging Face directory `hf_dir`. Collective.
    Returns {"tensors": read, "parameters": filled, "initialised": {part: [its global names]},
    "dropped": [Hugging Face names of parts the model does not build]}."""
    config = read_hf_config(hf_dir)
    family = tables.for_model_type(config.get("model_type", ""))
    names, read = hf_reader(hf_dir, family)
    vocab = cfg.model_vocab_size
    d = dims(cfg, vocab, padded_vocab_size(vocab, cfg))
    opts = options(cfg)
    every = family.table.rules_for(cfg)
    absent = absent_parts(every, names)
    initialise = {r.mcore for rs in absent.values() for r in rs}
    rules = {r.mcore: r for r in every if r.mcore not in initialise}
    present = set(names)
    dropped = sorted(h for r in family.table.unbuilt(opts, cfg.num_layers) for h in r.hf if h in present)
    check_coverage(family.table, list(rules.values()), [n for n in names if n not in dropped], where=hf_dir)
    n = load_global_weights(chunks, cfg, lambda g: to_mcore(rules[g], read, d), rules,
                            f"{hf_dir} ({family.name} table)", initialise=initialise)
    return {"tensors": len(names) - len(dropped), "parameters": n, "dropped": dropped,
            "initialised": {p: [r.mcore for r in rs] for p, rs in absent.items()}}


def describe_load(loaded: Dict, hf_dir: str) -> List[str]:
    """The lines that report a --load-hf / hf2mcore load: what was read, initialised and dropped."""
    lines = [f"loaded {loaded['tensors']} Hugging Face tensors from {hf_dir}"]
    for part, mcore in loaded.get("initialised", {}).items():
        lines.append(f"{hf_dir} has no {part}: initialised {len(mcore)} tensor(s) ({', '.join(mcore)}) with "
                     f"N(0, init_method_std) weights, unit norms and zero biases")
    if loaded.get("dropped"):
        lines.append(f"dropped {len(loaded['dropped'])} tensor(s) of parts the model does not build: "
                     f"{', '.join(loaded['dropped'])}")
    return lines
