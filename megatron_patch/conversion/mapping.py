"""A conversion table is data: rules naming a megatron-core tensor, the Hugging Face tensors it is made
of, and the transform between them. One engine (`to_mcore`, `to_hf`, `check_coverage`) applies any table.

Names: Hugging Face names are those of the checkpoint files; megatron-core names are the *global* names
of the unwrapped GPTModel's state dict (`decoder.layers.{i}.` with the global layer number), whatever
the TP/PP layout (megatron_patch.models.partition cuts them to a rank's slice). `{i}` runs over layers,
`{e}` over the experts of a mixture-of-experts layer (global expert numbers, whatever the EP layout:
`decoder.layers.{i}.mlp.experts.local_experts.{e}.`).
A rule can depend on an option of the model (`when`, a `When` predicate of the engine Config): tied or untied
output layer, biases, learned position embeddings, LayerNorm (with bias) or RMSNorm, BERT's binary head, a
shared expert, per-head query/key norms; and on the kind
of layer (`layers`): "moe" for the layers with experts, "dense" for the others (a model may mix them).
A rule can belong to an optional `part` of the model (BERT's MLM head, pooler, NSP head): a Hugging Face
checkpoint without any tensor of the part is still converted, the part being initialised (and reported)
instead of read; a part the model does not build (its rules' `when` is false) has its Hugging Face
tensors dropped (and reported).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from .transforms import IDENTITY, Dims, Transform


class TensorIndex:
    """`keys()`, `in` and `len()` of a checkpoint reader, over its `_where` (tensor name -> location)."""

    _where: Dict

    def keys(self) -> List[str]:
        """Every tensor name the checkpoint holds, in its order."""
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)


class ConversionError(ValueError):
    """A checkpoint that does not fit the table; the message names the tensor and file."""


@dataclass(frozen=True)
class When:
    """A model option a rule depends on: a named predicate of the engine Config (the name is for reading)."""
    name: str
    holds: Callable[[Any], bool]

    def __call__(self, cfg) -> bool:
        return bool(self.holds(cfg))


def _bias(cfg) -> bool:
    return not cfg.disable_bias_linear


def _shared_expert(cfg) -> bool:
    return bool(cfg.num_experts and cfg.moe_shared_expert_intermediate_size)


UNTIED = When("untied", lambda c: c.untie_embeddings_and_output_weights)
BIAS = When("bias", _bias)
QKV_BIAS = When("qkv_bias", lambda c: _bias(c) or c.add_qkv_bias)
LEARNED_POSITIONS = When("learned_positions", lambda c: c.position_embedding_type == "learned_absolute")
NORM_BIAS = When("norm_bias", lambda c: c.normalization == "LayerNorm")
BINARY_HEAD = When("binary_head", lambda c: c.bert_binary_head)
SHARED_EXPERT = When("shared_expert", _shared_expert)
SHARED_EXPERT_GATE = When("shared_expert_gate", lambda c: _shared_expert(c) and c.moe_shared_expert_gate)
QK_NORM = When("qk_norm", lambda c: c.qk_layernorm)
Q_LORA = When("q_lora", lambda c: c.q_lora_rank is not None)  # MLA's queries through a latent
NO_Q_LORA = When("no_q_lora", lambda c: c.q_lora_rank is None)  # MLA's queries straight from the hidden state
OPTIONS = (UNTIED, BIAS, QKV_BIAS, LEARNED_POSITIONS, NORM_BIAS, BINARY_HEAD, SHARED_EXPERT, SHARED_EXPERT_GATE,
           QK_NORM, Q_LORA, NO_Q_LORA)


@dataclass(frozen=True)
class Rule:
    mcore: str
    hf: Tuple[str, ...]
    transform: Transform = IDENTITY
    when: Optional[When] = None  # a model option that must hold for the rule to apply
    part: Optional[str] = None  # an optional part of the model (module docstring)
    layers: Optional[str] = None  # "moe" / "dense": only layers with / without experts (None: every layer)

    def at(self, i: int, key: str = "{i}") -> "Rule":
        return Rule(self.mcore.replace(key, str(i)), tuple(h.replace(key, str(i)) for h in self.hf),
                    self.transform, self.when, self.part, self.layers)


@dataclass(frozen=True)
class Table:
    """The mapping of one model family."""
    family: str
    rules: Tuple[Rule, ...]
    ignored_hf: Tuple[str, ...] = ()  # regexes of Hugging Face tensors that carry no weights (buffers)

    def expand(self, options: Dict[When, bool], num_layers: int, moe_layers: Sequence[int] = (),
               num_experts: int = 0) -> List[Rule]:
        """The concrete rules of one model: options applied, `{i}` filled for every layer of the rule's kind
        (`moe_layers`: the global numbers of the layers with experts), `{e}` for each of `num_experts`."""
        kinds = {None: range(num_layers), "moe": sorted(moe_layers),
                 "dense": [i for i in range(num_layers) if i not in set(moe_layers)]}
        out = []
        for r in self.rules:
            if r.when is not None and not options[r.when]:
                continue
            for layer in (r.at(i) for i in kinds[r.layers]) if "{i}" in r.mcore else [r]:
                out.extend(layer.at(e, "{e}") for e in range(num_experts)) if "{e}" in r.mcore else out.append(layer)
        return out

    def unbuilt(self, options: Dict[When, bool], num_layers: int) -> List[Rule]:
        """The rules of the optional parts that this model does not build at all (every rule's `when` false; a
        part with one rule off, such as the untied output layer of a tied MLM head, is built)."""
        built = {r.part for r in self.expand(options, num_layers)}
        return [r for r in self.expand({k: True for k in options}, num_layers)
                if r.part is not None and r.part not in built]

    def rules_for(self, cfg) -> List[Rule]:
        """`expand` for the model of an engine Config."""
        return self.expand(options(cfg), cfg.num_layers, cfg.moe_layers(), cfg.num_experts or 0)

    def ignored(self, hf_name: str) -> bool:
        return any(re.fullmatch(p, hf_name) for p in self.ignored_hf)


def absent_parts(rules: Sequence[Rule], hf_names: Iterable[str]) -> Dict[str, List[Rule]]:
    """part -> its rules, for each optional part of which the checkpoint has no tensor at all (a part with
    some tensors present is not absent: check_coverage then names the missing ones)."""
    present = set(hf_names)
    parts: Dict[str, List[Rule]] = {}
    for r in rules:
        if r.part is not None:
            parts.setdefault(r.part, []).append(r)
    return {p: rs for p, rs in parts.items() if not any(h in present for r in rs for h in r.hf)}


def options(cfg) -> Dict[When, bool]:
    """Whether each model option (`OPTIONS`) holds for an engine Config."""
    return {w: w(cfg) for w in OPTIONS}


def dims(cfg, vocab: int, padded_vocab: int) -> Dims:
    return Dims(heads=cfg.num_attention_heads, groups=cfg.num_query_groups or cfg.num_attention_heads,
                head_dim=cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads, vocab=vocab,
                padded_vocab=padded_vocab)


def to_mcore(rule: Rule, read_hf: Callable[[str], torch.Tensor], d: Dims) -> torch.Tensor:
    """The megatron-core tensor of `rule`, read from the Hugging Face side."""
    try:
        return rule.transform.to_mcore([read_hf(h) for h in rule.hf], d)
    except (RuntimeError, ValueError) as e:  # shapes that do not fit the config
        raise ConversionError(f"{', '.join(rule.hf)} -> {rule.mcore} ({rule.transform.name}): {e}; the weights do "
                              f"not match config.json (heads, query groups, sizes)") from None


def to_hf(rules: Sequence[Rule], read_mcore: Callable[[str], torch.Tensor], d: Dims) -> Iterator[Tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every rule, reading one megatron-core tensor at a time."""
    for rule in rules:
        try:
            parts = rule.transform.to_hf(read_mcore(rule.mcore), d)
        except (RuntimeError, ValueError) as e:
            raise ConversionError(f"{rule.mcore} -> {', '.join(rule.hf)} ({rule.transform.name}): {e}") from None
        yield from zip(rule.hf, parts)


def check_coverage(table: Table, rules: Sequence[Rule], hf_names: Iterable[str], where: str) -> None:
    """Every tensor the rules need is present, and every tensor present is used (or known to carry nothing)."""
    present = set(hf_names)
    needed = {h for r in rules for h in r.hf}
    missing = sorted(needed - present)
    if missing:
        raise ConversionError(f"{where} lacks {len(missing)} tensor(s) the {table.family} table needs, e.g. "
                              f"{', '.join(missing[:3])}; is it a {table.family} checkpoint with this config.json?")
    unused = sorted(n for n in present - needed if not table.ignored(n))
    if unused:
        raise ConversionError(f"{where} has {len(unused)} tensor(s) the {table.family} table does not use, e.g. "
                              f"{', '.join(unused[:3])}: converting would drop them. The model has parts the "
                              f"engine does not build (check config.json), or the table lacks a rule.")
