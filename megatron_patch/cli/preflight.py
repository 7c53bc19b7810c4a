"""What the launching process checks before any worker starts: the model directory and the data.

A mistake found here is one `rapidformer: error:` line with exit status 2, printed once however many workers
the run would have had; found in the workers it would be one traceback per worker.

Nothing is downloaded (`offline()`): a model named by a hub id must already be in the local Hugging Face
cache, and the workers inherit HF_HUB_OFFLINE=1, so no library waits on network retries.
"""
from __future__ import annotations

import argparse
import os

from megatron_patch.config.rapidformer_flags import FINETUNE_TASKS, TASKS, UsageError

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def offline() -> None:
    """Force the Hugging Face libraries offline in this process and in the workers it starts (they read these
    variables when imported, so this runs before any of them is)."""
    os.environ.update(OFFLINE_ENV)


def _in_hub_cache(name: str) -> bool:
    """True when hub model `name` has a config.json in the local Hugging Face cache (no request is made)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repository id (e.g. a path with several slashes): not in the cache
        return False


def check_model(args: argparse.Namespace) -> None:
    """--pretrained-model-name-or-path (and, for black-box fine-tuning, --load) must be a local model directory
    or a name in the local Hugging Face cache. Cheap: no torch or transformers import."""
    blackbox = bool(args.task) and not args.user_script
    flags = [("--pretrained-model-name-or-path", args.pretrained_model_name_or_path)]
    if blackbox and args.task in FINETUNE_TASKS and args.load != args.pretrained_model_name_or_path:
        flags.append(("--load", args.load))
    for flag, value in flags:
        if not value:
            continue
        if os.path.isdir(value):
            if blackbox and not os.path.isfile(os.path.join(value, "config.json")):
                raise UsageError(f"{flag} {value}: no config.json in that directory; give a Hugging Face model "
                                 "directory (save_pretrained writes one)")
            continue
        if os.path.exists(value):
            raise UsageError(f"{flag} {value} is a file; give the model's directory (config.json and weights)")
        if not _in_hub_cache(value):
            from huggingface_hub.constants import HF_HUB_CACHE

            raise UsageError(f"{flag} {value}: not a local directory and not in the local Hugging Face cache "
                             f"({HF_HUB_CACHE}); nothing is downloaded (no network): pass a local directory "
                             "holding the model's config.json and weights (e.g. written by save_pretrained)")


def check_data(args: argparse.Namespace) -> None:
    """The black-box tasks' data: fine-tuning files loaded and their columns found (the workers then read the
    datasets cache); pretraining's mmap prefix and vocabulary present. White-box scripts read their data
    themselves, so theirs is not checked here."""
    if args.user_script or not args.task or not args.data_path:  # a missing --data-path: the rules' message
        return
    if args.task in FINETUNE_TASKS:
        import datasets

        from megatron_patch.data.finetune_data import load_finetune_dataset
        from megatron_patch.data.task_columns import find_task_columns

        bars = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # the workers show theirs; this load only fills the cache they read
        try:
            dd = load_finetune_dataset(args.data_path, args.data_name, args.data_dir)
            find_task_columns(args.task, dd, args.text_columns, args.label_column)
        finally:
            if bars:
                datasets.enable_progress_bars()
        return
    from megatron_patch.data.checks import parse_data_path

    parse_data_path([args.data_path] if os.path.isfile(args.data_path + ".idx") else args.data_path.split())
    for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
        if path and not os.path.isfile(path):
            raise UsageError(f"{flag} {path}: no such file")


def check_shapes(args: argparse.Namespace) -> None:
    """What the model directory of a black-box run decides, from its config: fine-tuning loads the model as it
    is, so a shape flag must agree with its config (the same rule the templates apply to the model a script
    builds, `templates.rules.shape_flags`); a setting flag (--hidden-dropout ...) needs a config that has the setting;
    --task pretraining's model kind (BERT-style or causal) says which data flags act (`flag_use`)."""
    from megatron_patch.templates.rules.shape_flags import SETTING_FLAGS, SHAPE_FLAGS, config_settings, mismatches

    if args.user_script or args.task not in TASKS:
        return
    pretraining = args.task == "pretraining"
    flags = [*SHAPE_FLAGS, *SETTING_FLAGS]
    if not pretraining and all(getattr(args, f) is None for f in flags):
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.pretrained_model_name_or_path if pretraining else args.load)
    config_settings(args, config)  # a ConfigError (a ValueError) when the config has no such setting
    if pretraining:
        from megatron_patch.config.flag_use import refuse_unused
        from .tasks.pretraining import model_kind

        refuse_unused(args, ("pt",), model_kind(config))
        return
    bad = mismatches(args, config)
    if bad:
        flags = " ".join(f"--{f.replace('_', '-')} {given}" for f, (_, _, given) in bad.items())
        found = ", ".join(f"{name} {value if value is not None else '(none)'}" for name, value, _ in bad.values())
        raise UsageError(f"{flags}: fine-tuning trains the model in {args.load} as it is ({found} in its "
                         "config); the shape flags cannot change it: drop them")


def check_padding_free(args: argparse.Namespace) -> None:
    """--padding-free in black-box fine-tuning: the model directory's config must be a family the packed forward
    runs (accelerations/padding_free.py); a script's model is checked where the Finetuner builds it."""
    if not getattr(args, "padding_free", False) or args.user_script or args.task not in FINETUNE_TASKS:
        return
    from transformers import AutoConfig

    from megatron_patch.accelerations.padding_free import config_refusal

    problem = config_refusal(AutoConfig.from_pretrained(args.load))
    if problem:
        raise UsageError(f"{problem} (the model in {args.load})")
