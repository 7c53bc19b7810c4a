"""The `rapidformer` command line: every flag of the Rapidformer parameter guide, with its defaults.

The front end has its own rules (`check`), separate from the Megatron engine's `validate()`: the how-to's
commands omit flags the guide marks required (`--save`, `--train-iters` with `--epochs`), and they still
run, with the default named in one log line. Impossible combinations are refused here, before any worker
starts, in a sentence that names the flags and the fix.
"""
from __future__ import annotations

import argparse
import json
from typing import List, Optional

from . import flag_parser
from .flags import COMPILE_MODES, FINETUNE_TASKS, RAPIDFORMER, TASKS  # noqa: F401  (re-exported: read from here)

DESCRIPTION = ("Fine-tune or pretrain Transformers with switchable accelerations; nothing is downloaded "
               "(models and data are local). Black-box fine-tuning: --task sequence_classification (or "
               "another fine-tuning task) with --pretrained-model-name-or-path DIR and --data-path DIR of "
               "train/validation files. Black-box pretraining: --task pretraining trains the Hugging Face "
               "model in --pretrained-model-name-or-path DIR (BERT-style: masked LM + next-sentence prediction; "
               "causal LMs: next token) for --train-iters iterations on a Megatron mmap corpus "
               "(--data-path PREFIX from tools/preprocess_data.py) with its --tokenizer-type and --vocab-file; "
               "shape flags (--num-layers, --hidden-size, ...) that differ from the directory's config start "
               "a model of that shape from new weights. White box: --user-script FILE with a Finetuner or "
               "PreTrainer subclass.")


class UsageError(ValueError):
    """A command line the front end refuses; the message names the flags and the fix."""


def build_parser() -> argparse.ArgumentParser:
    """The `rapidformer` parser, generated from the flag registry (config/flags.py): every flag in the namespace,
    at its default when not given."""
    return flag_parser.build_parser(RAPIDFORMER, prog="rapidformer", description=DESCRIPTION)


_UNSET = object()


def _given(argv: Optional[List[str]], dests) -> frozenset:
    """The dests set on the command line: parsed again into a namespace already holding a marker for every dest,
    so argparse applies no default (a flag left at its default and one given with the default value differ)."""
    marked = argparse.Namespace(**dict.fromkeys(dests, _UNSET))
    return frozenset(k for k, v in vars(build_parser().parse_args(argv, namespace=marked)).items() if v is not _UNSET)


def given_flags(args: argparse.Namespace) -> frozenset:
    """The dests the user gave (`args.given`, set by parse_args). A namespace built another way (a test, a script's
    own Namespace) has none recorded: then the dests whose value differs from the parser's default."""
    given = getattr(args, "given", None)
    if given is not None:
        return given
    defaults = vars(build_parser().parse_args([]))
    return frozenset(k for k, v in vars(args).items() if k in defaults and v != defaults[k])


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse the command line and add the names the documented samples read: `dataset_path`/`dataset_name`
    (= --data-path/--data-name), `load` (defaults to --pretrained-model-name-or-path) and `causal_lm` for
    the guide's `casual_lm`; `given` is the set of dests given on the command line (the front end's rules fill
    in defaults later, and a flag must not be refused for a value it was never given). Raises SystemExit(2)
    with argparse's message on an unknown flag."""
    args = build_parser().parse_args(argv)
    args.given = _given(argv, vars(args))
    args.dataset_path, args.dataset_name = args.data_path, args.data_name
    if args.load is None:
        args.load = args.pretrained_model_name_or_path
    if args.task == "casual_lm":
        args.task = "causal_lm"
    args.notes = []  # one log line per default the front end chose
    return args


def dump_checked(args: argparse.Namespace, path: str) -> None:
    """Write the flags as the front end's rules left them (defaults chosen, notes made) for the workers, which then
    run with them instead of checking the command line again: the rules run once, in the launching process."""
    values = dict(vars(args), given=sorted(args.given))
    with open(path, "w") as f:
        json.dump(values, f)


def load_checked(path: str) -> argparse.Namespace:
    """The flags `dump_checked` wrote."""
    with open(path) as f:
        values = json.load(f)
    values["given"] = frozenset(values["given"])
    return argparse.Namespace(**values)
