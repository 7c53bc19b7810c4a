"""A model family the conversion knows, as one typed record, and the registry of them (name -> family).

A family is its conversion table (mapping.Table), the two directions of its configuration mapping
(config.json -> engine Config fields, engine Config -> config.json) and its optional parts, each with a
default that does nothing special: the name prefix a bare base-model checkpoint omits, the hook that adapts
an export's config.json. The family modules (tables/) build one `Family` each; tables/__init__.py registers
them, and lookups go through the registry, which names the known families when asked for another one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from .mapping import ConversionError, Table


def same_config(hf_config: Dict, cfg: Any) -> Dict:
    """The default export hook: config.json of an export is the one it was converted from, unchanged."""
    return hf_config


@dataclass(frozen=True)
class Family:
    """One model family: its table, its configuration mapping in both directions, its optional parts."""
    table: Table
    model_types: Tuple[str, ...]  # config.json model_type values of the family
    engine_families: Tuple[str, ...]  # --model-family values (Config.model_family) of the family
    engine_args: Callable[[Dict], Dict]  # config.json -> engine Config fields (ConversionError: not supported)
    hf_config: Callable[[Any, int, Optional[int]], Dict]  # (engine Config or its dict, vocab, end-of-document id)
    hf_prefix: str = ""  # a name prefix that bare base-model checkpoints omit (restored on reading)
    export_config: Callable[[Dict, Any], Dict] = same_config  # (config.json of the original, engine Config)

    @property
    def name(self) -> str:
        return self.table.family


class Registry:
    """name -> Family, with the lookups the conversion needs; unknown names are refused in words."""

    def __init__(self) -> None:
        self._families: Dict[str, Family] = {}

    def register(self, family: Family) -> Family:
        """Add `family`; a second family under a name, model_type or --model-family already taken is a bug."""
        taken = {n for f in self._families.values() for n in (f.name, *f.model_types, *f.engine_families)}
        clash = {family.name, *family.model_types, *family.engine_families} & taken
        if clash and self._families.get(family.name) is not family:
            raise ValueError(f"family {family.name}: {', '.join(sorted(clash))} already registered")
        self._families[family.name] = family
        return family

    def __iter__(self) -> Iterator[Family]:
        return iter(self._families.values())

    def names(self) -> Tuple[str, ...]:
        return tuple(sorted(self._families))

    def get(self, name: str) -> Family:
        """The family registered as `name` (e.g. "llama")."""
        if name not in self._families:
            raise ConversionError(f"unknown model family {name!r}: the conversion knows {', '.join(self.names())}")
        return self._families[name]

    def model_types(self) -> Tuple[str, ...]:
        return tuple(sorted(t for f in self for t in f.model_types))

    def engine_families(self) -> Tuple[str, ...]:
        return tuple(sorted(n for f in self for n in f.engine_families))

    def for_model_type(self, model_type: str) -> Family:
        """The family of a config.json's model_type."""
        for f in self:
            if model_type in f.model_types:
                return f
        raise ConversionError(f"config.json model_type {model_type!r}: conversion supports "
                              f"{', '.join(self.model_types())}")

    def for_engine_family(self, name: Optional[str]) -> Optional[Family]:
        """The family a --model-family value names; None for None or a name no family has."""
        return next((f for f in self if name in f.engine_families), None) if name else None
