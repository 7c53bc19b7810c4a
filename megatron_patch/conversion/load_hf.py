"""`--load-hf DIR`: Hugging Face weights loaded straight into this rank's model chunks, whatever the
TP/PP/VPP layout, with no intermediate files. Each parameter is built in full by the family's table
(one tensor at a time, read from the safetensors shard that holds it) and cut to this rank's slice.

Coverage is checked, not assumed: every parameter starts as NaN and must be written; every Hugging
Face tensor must be used by some rule (or be a known buffer); and across all ranks every rule of the
table must have found its parameter."""
from __future__ import annotations

import math
from typing import Callable, Dict, Iterable, List

import torch
import torch.distributed as dist

from megatron_patch.models.gpt import padded_vocab_size
from megatron_patch.models.partition import global_name, local_shard

from . import tables
from .hf_io import HFCheckpointReader, read_hf_config
from .mapping import ConversionError, check_coverage, dims, to_mcore


def hf_reader(hf_dir: str, family) -> "callable":
    """(names, read) for a Hugging Face directory, with the family's optional name prefix restored."""
    reader = HFCheckpointReader(hf_dir)
    names = list(reader.keys())
    prefix = getattr(family, "HF_PREFIX", "")
    if prefix and names and not any(n.startswith(prefix) for n in names):
        return [prefix + n for n in names], lambda n: reader.get(n[len(prefix):] if n.startswith(prefix) else n)
    return names, reader.get


@torch.no_grad()
def load_global_weights(chunks: List[torch.nn.Module], cfg, get: Callable[[str], torch.Tensor], expected: Iterable[str],
                        where: str) -> int:
    """Fill every parameter of this rank's unwrapped GPTModel `chunks` with its slice of the global tensor
    `get(global name)`; every name in `expected` must land in some rank's parameter. Collective."""
    expected = set(expected)
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
            shard = local_shard(get(gname), p, gname, cfg.swiglu)
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


def load_hf_weights(chunks: List[torch.nn.Module], cfg, hf_dir: str) -> Dict[str, int]:
    """Fill the unwrapped GPTModel `chunks` of this rank from the Hugging Face directory `hf_dir`. Collective."""
    config = read_hf_config(hf_dir)
    family = tables.for_model_type(config.get("model_type", ""))
    names, read = hf_reader(hf_dir, family)
    vocab = cfg.model_vocab_size
    d = dims(cfg, vocab, padded_vocab_size(vocab, cfg))
    rules = {r.mcore: r for r in family.TABLE.rules_for(cfg)}
    check_coverage(family.TABLE, list(rules.values()), names, where=hf_dir)
    n = load_global_weights(chunks, cfg, lambda g: to_mcore(rules[g], read, d), rules, f"{hf_dir} ({family.TABLE.family} table)")
    return {"tensors": len(names), "parameters": n}
