"""Print where every flag and every configuration field lives (Markdown), read from the flag registry
(megatron_patch/config/flags.py) and the typed Config (megatron_patch/config/config.py).

    python scripts/config_map.py            # both tables
    python scripts/config_map.py fields     # Config fields only: flat name -> section.field
    python scripts/config_map.py flags      # flags only: option strings, entry points, where the value goes

A flag's value goes to a Config field (`section.field`, read flat as `cfg.<field>` as Megatron-LM names it) or,
for a flag only `rapidformer` takes, to the front end's `args.<dest>` (get_args() in a user script).
"""
from __future__ import annotations

import sys
from typing import List

from megatron_patch.config.config import FLAG_NAMES, HOME, SECTIONS
from megatron_patch.config.flags import ENGINE, FLAGS, RAPIDFORMER, declarations

# the flags' booleans are views of two enums (Config keeps them readable by these names, and old checkpoints'
# stored booleans load into the enums)
_VIEWS = {"bf16": "numerics.precision (= bf16)", "fp16": "numerics.precision (= fp16)",
          "mixed_precision": "numerics.precision (= fp16: Rapidformer's --mixed-precision)"}


def _home(field: str) -> str:
    if field in _VIEWS:
        return _VIEWS[field]
    if field.startswith("zero_") and field in FLAG_NAMES:
        return f"parallel.zero_stage (= {field.split('_')[1]})"
    section = HOME.get(field)
    return f"{section}.{field}" if section else ""


def fields() -> List[str]:
    rows = ["| Config field (flat, as read) | section.field |", "|---|---|"]
    for section, cls in SECTIONS.items():
        for name in cls.__dataclass_fields__:
            rows.append(f"| `{name}` | `{section}.{name}` |")
    for name in FLAG_NAMES:
        rows.append(f"| `{name}` (boolean view) | `{_home(name)}` |")
    return rows


def flags() -> List[str]:
    rows = ["| flag (aliases) | entry points | value goes to |", "|---|---|---|"]
    for f in FLAGS:
        names = ", ".join(f"`{n}`" for n in f.names)
        if RAPIDFORMER in f.entries and f.front is not None and f.front.names:
            names += " (rapidformer: " + ", ".join(f"`{n}`" for n in f.front.names) + ")"
        if f.entries & ENGINE:
            home = f"Config `{_home(f.dest)}`"
            if RAPIDFORMER in f.entries and f.dest_for(RAPIDFORMER) != f.dest:
                home += f"; rapidformer `args.{f.dest_for(RAPIDFORMER)}`"
        else:
            home = f"rapidformer `args.{f.dest}`"
        rows.append(f"| {names} | {', '.join(sorted(f.entries))} | {home} |")
    counts = declarations()
    rows.append("")
    rows.append(f"{counts['flags']} flags declared once each ({counts['option_strings']} option strings).")
    return rows


def main(argv: List[str]) -> None:
    which = argv[0] if argv else "both"
    if which not in ("both", "fields", "flags"):
        raise SystemExit(f"config_map.py: {which!r}: give fields, flags or nothing (both)")
    if which in ("both", "fields"):
        print("\n".join(fields()))
    if which == "both":
        print()
    if which in ("both", "flags"):
        print("\n".join(flags()))


if __name__ == "__main__":
    main(sys.argv[1:])
