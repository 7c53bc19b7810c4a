"""The repeated blocks of a model (transformer layers): the units FSDP2 shards one by one, and the units
activation checkpointing recomputes when the model has no checkpointing of its own."""
from __future__ import annotations

from typing import Dict, List, Set

import torch


def find_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The outermost modules whose class is named in `model._no_split_modules` (transformers sets it to the
    decoder/encoder layer classes, e.g. ["LlamaDecoderLayer"]); when that is absent or matches nothing, the
    items of the outermost nn.ModuleLists (e.g. BERT's `bert.encoder.layer`). Modules whose parameters are
    shared with modules outside them (tied weights) are left out: FSDP2 cannot shard one parameter in two
    units, and they stay with the root."""
    names: Set[str] = set(getattr(model, "_no_split_modules", None) or [])
    found: List[torch.nn.Module] = []
    if names:
        found = _outermost(model, lambda m: type(m).__name__ in names)
    if not found:
        lists = _outermost(model, lambda m: isinstance(m, torch.nn.ModuleList))
        found = [item for lst in lists for item in lst]
    uses = _uses(model)
    return [m for m in found if not _shares_parameters(m, uses)]


def _outermost(model: torch.nn.Module, match) -> List[torch.nn.Module]:
    out: List[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if match(child):
                out.append(child)
            else:
                visit(child)

    visit(model)
    return out


def _uses(module: torch.nn.Module) -> Dict[int, int]:
    """id(parameter) -> how many module attributes under `module` hold it."""
    count: Dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        count[id(p)] = count.get(id(p), 0) + 1
    return count


def _shares_parameters(unit: torch.nn.Module, model_uses: Dict[int, int]) -> bool:
    return any(model_uses[i] > n for i, n in _uses(unit).items())
