"""The argparse parsers of the entry points, generated from the flag registry (`flags.FLAGS`).

`build_parser(entry)` makes the parser of "gpt" (pretrain_megatron_gpt.py), "bert" (pretrain_megatron_bert.py)
or "rapidformer": the entry's flags in --help groups by concern, each with its help and default. The engine's
parsers leave a flag that is not given out of the namespace (argparse.SUPPRESS: only flags given override the
presets); rapidformer's namespace holds every flag, at its default when not given. A flag of another entry point is
refused before parsing, in words naming the entry point that takes it (`wrong_entry`).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

from .flags import BERT, BY_NAME, CONCERNS, ENGINE, ENTRY_NAMES, GPT, RAPIDFORMER, for_entry


@dataclass(frozen=True)
class Entry:
    prog: str  # as the user runs it
    does: str  # what it is for
    run: str  # how to run it


ENTRIES = {
    GPT: Entry("pretrain_megatron_gpt.py", "GPT/Llama-family pretraining on the Megatron engine",
               "pretrain_megatron_gpt.py (pretrain_scripts/run_gpt.sh)"),
    BERT: Entry("pretrain_megatron_bert.py", "BERT pretraining on the Megatron engine",
                "pretrain_megatron_bert.py (pretrain_scripts/run_bert.sh)"),
    RAPIDFORMER: Entry("rapidformer", "Hugging Face fine-tuning and pretraining", "rapidformer"),
}
# a flag both engine entry points take is said once for the two
_ENGINE = Entry("pretrain_megatron_gpt.py / pretrain_megatron_bert.py", "pretraining on the Megatron engine",
                "pretrain_megatron_gpt.py or pretrain_megatron_bert.py (pretrain_scripts/run_gpt.sh, run_bert.sh)")


def _takers(entries: Iterable[str]) -> List[Entry]:
    entries = set(entries)
    out = [_ENGINE] if ENGINE <= entries else [ENTRIES[e] for e in (GPT, BERT) if e in entries]
    return out + ([ENTRIES[RAPIDFORMER]] if RAPIDFORMER in entries else [])


def wrong_entry(entry: str, argv: Sequence[str]) -> Optional[str]:
    """The refusal of the first flag in `argv` (`--flag` or `--flag=value`) that `entry` does not take but another
    entry point does, naming that one; None when there is none (an unknown flag is argparse's to report)."""
    for token in argv:
        if token == "--":  # what follows is positional
            break
        if not token.startswith("--"):
            continue
        name = token.split("=", 1)[0]
        flag = BY_NAME.get(name)
        if flag is None or name in flag.names_for(entry) and entry in flag.entries:
            continue
        if entry in flag.entries:  # an alias this entry point does not spell
            prog = ENTRIES[entry].prog
            return f"{name} is not one of {prog}'s flags: {prog} spells it {flag.names_for(entry)[0]}"
        takers = _takers(flag.entries)
        return (f"{name} is a {' / '.join(t.prog for t in takers)} flag (it applies to "
                f"{'; '.join(t.does for t in takers)}), not one of {ENTRIES[entry].prog}'s; run it with "
                f"{' or '.join(t.run for t in takers)}")
    return None


class EntryParser(argparse.ArgumentParser):
    """The parser of one entry point: refuses another entry point's flag (`refuse`: like argparse's other usage
    errors, one line on stderr and exit status 2; the engine's parser raises ConfigError instead)."""

    entry: str = RAPIDFORMER

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        message = wrong_entry(self.entry, args)
        if message:
            self.refuse(message)
        return super().parse_known_args(args, namespace)

    def refuse(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _shown(value) -> bool:
    return value is not None and value != [] and not isinstance(value, bool)


def build_parser(entry: str, parser_class: type = EntryParser, description: str = "",
                 prog: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser of `entry` ("gpt", "bert" or "rapidformer"), generated from the registry."""
    if entry not in ENTRY_NAMES:
        raise ValueError(f"unknown entry point {entry!r}: one of {', '.join(ENTRY_NAMES)}")
    engine = entry in ENGINE
    p = parser_class(prog=prog, description=description, allow_abbrev=False,
                     # the engine: only flags given on the command line override presets/defaults
                     argument_default=argparse.SUPPRESS if engine else None)
    p.entry = entry
    flags = for_entry(entry)
    for concern, title in CONCERNS:
        group = None
        for f in (f for f in flags if f.concern == concern):
            group = group or p.add_argument_group(title)
            default = f.default_for(entry)
            text = f.help_for(entry)
            if not f.is_switch and _shown(default):
                text += f" (default: {default})"
            kwargs = dict(dest=f.dest_for(entry), help=text.replace("%", "%%"))
            if f.is_switch:
                kwargs["action"] = f.kind
            else:
                if f.kind is not str:
                    kwargs["type"] = f.kind
                choices, nargs = f.choices_for(entry), f.nargs_for(entry)
                if choices:
                    kwargs["choices"] = list(choices)
                if nargs:
                    kwargs["nargs"] = nargs
                if f.metavar:
                    kwargs["metavar"] = f.metavar
            if not engine:
                kwargs["default"] = default
            group.add_argument(*f.names_for(entry), **kwargs)
    return p
