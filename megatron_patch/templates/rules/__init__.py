"""The front end's own rules (the parameter guide's notes), checked once, in the launching process, before any
worker starts (the workers get the flags as checked: cli/launch.py).

The package: here the command line's rules; `table.py` the front end's rule table; `megatron_model.py` and
`pretrainer.py` the rules that run once the user's script says what it built; `shape_flags.py` the shape and
setting flags compared with a built Hugging Face model.

`check(args, world_size)` = `resolve_front` (the defaults of flags the guide marks required but the how-to's own
commands leave out, each named in `args.notes`, printed once as a log line each; no I/O) and then the front
end's table of named rules by concern (table.py, on the engine's frame), each returning its refusal
(a sentence naming the flags and the fix; a flag the run would ignore included: `flag_use`) or None; the first
refusal is raised as UsageError.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

from megatron_patch.config.rapidformer_flags import FINETUNE_TASKS, UsageError
from megatron_patch.config.flag_use import refuse_unused, run_kinds

from .table import MODEL_CONCERNS, front_rule, run_front

DEFAULT_EPOCHS = 3
DEFAULT_LR = 5e-5
DEFAULT_MICRO_BATCH = 8
DEFAULT_GRAPH_PAD = 64  # tokens: lengths 1-512 give at most 8 batch shapes, so 8 CUDA graphs
# --padding-free's packed rows: a micro batch of 32 BERT samples (about 4,400 tokens, +-400) spans about 10 budgets
# of 256 tokens (one CUDA graph each) at a cost of 128 filler tokens (3%) on average; eager runs take finer steps
DEFAULT_PACKED_ROW = 64
DEFAULT_PACKED_ROW_GRAPHS = 256
PADDING_FREE_TASKS = ("sequence_classification", "token_classification")


def _note(args: argparse.Namespace, text: str) -> None:
    args.notes.append(text)


def _data_parallel(args: argparse.Namespace, world_size: int) -> int:
    # data-parallel workers: tensor/pipeline parallelism (Megatron models) share one batch among TP x PP ranks
    return max(1, world_size // max(1, args.tensor_model_parallel_size * args.pipeline_model_parallel_size))


# ---- defaults (no refusals, no I/O)
def resolve_front(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Fill in the defaults the front end chooses (each named in `args.notes`) for a run of `world_size` workers."""
    if args.task == "pretraining" and not args.user_script and not args.save:
        args.save = os.path.join("rapidformer_output", "pretraining")
        _note(args, f"--save not given: checkpoints and the final model are saved to {args.save}")
    if (not args.user_script and args.task in FINETUNE_TASKS and args.pretrained_model_name_or_path
            and args.data_path and not args.save):
        args.save = os.path.join("rapidformer_output", args.task)
        _note(args, f"--save not given: the model and tokenizer are saved to {args.save}")
    _resolve_schedule(args, world_size)
    _resolve_compile(args)
    _resolve_padding_free(args)
    if args.metrics_file is None and args.save:
        args.metrics_file = os.path.join(args.save, "metrics.jsonl")
    if args.tensorboard_dir is None and args.save:
        args.tensorboard_dir = os.path.join(args.save, "tensorboard")
    return args


def _resolve_schedule(args: argparse.Namespace, world_size: int) -> None:
    if args.lr is None:
        args.lr = DEFAULT_LR
        _note(args, f"--lr not given: using {DEFAULT_LR}")
    if args.task == "pretraining" or (args.user_script and args.task is None and args.train_iters):
        pass  # pretraining is iteration-based (the PreTrainer refuses a run without --train-iters)
    elif args.train_iters is None and args.epochs is None:
        args.epochs = DEFAULT_EPOCHS
        _note(args, f"neither --train-iters nor --epochs given: training {DEFAULT_EPOCHS} epochs")
    elif args.train_iters is not None and args.epochs is not None:
        _note(args, f"--train-iters {args.train_iters} and --epochs {args.epochs}: training stops at whichever "
                    "comes first")
    if args.micro_batch_size is None:
        args.micro_batch_size = DEFAULT_MICRO_BATCH
        _note(args, f"--micro-batch-size not given: using {DEFAULT_MICRO_BATCH} per worker")
    data_parallel = _data_parallel(args, world_size)
    per_step = args.micro_batch_size * data_parallel
    args.grad_accumulation = 1
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    elif args.epochs is not None and args.train_iters is None:
        if args.global_batch_size != per_step:
            _note(args, f"--global-batch-size {args.global_batch_size} is not used in epoch-based fine-tuning "
                        f"(no gradient accumulation there, as the guide says): each step takes "
                        f"--micro-batch-size {args.micro_batch_size} x {data_parallel} workers = {per_step} samples")
            args.global_batch_size = per_step
    elif per_step > 0 and args.global_batch_size % per_step == 0:  # else refused by global_batch below
        args.grad_accumulation = args.global_batch_size // per_step
        if args.grad_accumulation > 1:
            _note(args, f"gradient accumulation: {args.grad_accumulation} micro batches per step "
                        f"({args.global_batch_size} = {args.micro_batch_size} x {data_parallel} workers x "
                        f"{args.grad_accumulation})")


def _resolve_compile(args: argparse.Namespace) -> None:
    from megatron_patch.accelerations.compile import uses_cuda_graphs

    if args.torch_compile_mode and not args.torch_compile:
        args.torch_compile = True
        _note(args, f"--torch-compile-mode {args.torch_compile_mode} turns on --torch-compile")
    if uses_cuda_graphs(args) and args.pad_to_multiple_of is None:
        # a CUDA graph is recorded per batch shape: padding to exact lengths would record one per length
        args.pad_to_multiple_of = DEFAULT_GRAPH_PAD
        _note(args, f"--torch-compile-mode {args.torch_compile_mode} records a CUDA graph per batch shape: batches "
                    f"are padded to a multiple of {DEFAULT_GRAPH_PAD} tokens (--pad-to-multiple-of to change)")


def _resolve_padding_free(args: argparse.Namespace) -> None:
    """--padding-free: the multiple of tokens each packed training row is padded to (`args.packed_row_multiple`):
    --pad-to-multiple-of when given (evaluation batches, which stay padded, take it too), else 64, or 256 under
    CUDA graphs (evaluation batches keep the graphs' 64)."""
    from megatron_patch.accelerations.compile import uses_cuda_graphs
    from megatron_patch.config.rapidformer_flags import given_flags

    if not getattr(args, "padding_free", False):
        return
    if "pad_to_multiple_of" in given_flags(args) and args.pad_to_multiple_of is not None:
        args.packed_row_multiple = args.pad_to_multiple_of
        return
    graphs = uses_cuda_graphs(args)
    args.packed_row_multiple = DEFAULT_PACKED_ROW_GRAPHS if graphs else DEFAULT_PACKED_ROW
    _note(args, f"--padding-free: each training micro batch is one row of tokens padded to a multiple of "
                f"{args.packed_row_multiple}" + (f" (one CUDA graph per such token budget under --torch-compile-mode "
                                                 f"{args.torch_compile_mode})" if graphs else "")
                + " (--pad-to-multiple-of to change)")


# ---- the rules, in the order they speak
@front_rule("launch")
def task_or_script(args: argparse.Namespace, world_size: int) -> Optional[str]:
    if not args.task and not args.user_script:
        return ("give --task (one of sequence_classification, token_classification, question_answering, "
                "masked_lm, causal_lm, seq2seq_lm) for black-box fine-tuning, --task pretraining for "
                "black-box pretraining, or --user-script FILE for your own Finetuner or PreTrainer")
    if args.user_script and not os.path.isfile(args.user_script):
        return f"--user-script {args.user_script}: no such file"


@front_rule("launch")
def blackbox_pretraining_inputs(args: argparse.Namespace, world_size: int) -> Optional[str]:
    if args.task != "pretraining" or args.user_script:
        return None
    missing = [f for f, v in (("--pretrained-model-name-or-path", args.pretrained_model_name_or_path),
                              ("--data-path", args.data_path), ("--tokenizer-type", args.tokenizer_type),
                              ("--vocab-file", args.vocab_file), ("--train-iters", args.train_iters)) if not v]
    if missing:
        return (f"--task pretraining needs {', '.join(missing)}: a local Hugging Face model directory "
                "(its config gives the architecture), a Megatron mmap corpus made by "
                "tools/preprocess_data.py (BERT: --split-sentences, the _text_sentence prefix; GPT: the "
                "_text_document prefix), its tokenizer and the number of iterations")


@front_rule("launch")
def blackbox_finetuning_inputs(args: argparse.Namespace, world_size: int) -> Optional[str]:
    if args.user_script or args.task not in FINETUNE_TASKS:
        return None
    if not args.pretrained_model_name_or_path:
        return (f"--task {args.task} needs --pretrained-model-name-or-path (a local Hugging Face model "
                "directory)")
    if not args.data_path:
        return (f"--task {args.task} needs --data-path (a directory of train/validation files, a "
                "save_to_disk directory, or a dataset in the local Hugging Face cache)")


@front_rule("parallel")
def finetuning_is_data_parallel(args: argparse.Namespace, world_size: int) -> Optional[str]:
    # a --user-script without --task may be a PreTrainer: its template refuses what does not apply
    if args.task not in FINETUNE_TASKS:
        return None
    for flag, value in (("--tensor-model-parallel-size", args.tensor_model_parallel_size),
                        ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size)):
        if value != 1:
            return (f"{flag} {value}: tensor and pipeline parallelism apply to Megatron models in "
                    "pretraining (the PreTrainer template); fine-tuning a Hugging Face model is data "
                    f"parallel. Drop {flag}, or shard the model with --zero-3-memory-optimization")
    if args.data_iterator == "dynamic-shape":
        return ("--data-iterator dynamic-shape belongs to pretraining (the PreTrainer template, as the "
                "guide says); fine-tuning already pads each batch to its longest sample: drop the flag")
    if args.num_experts:
        return (f"--num-experts {args.num_experts}: mixture-of-experts layers are built in Megatron "
                "pretraining models, not added to a Hugging Face model being fine-tuned: drop the flag")


@front_rule("schedule")
def one_warmup(args: argparse.Namespace, world_size: int) -> Optional[str]:
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters is not None:
        return "--lr-warmup-fraction and --lr-warmup-iters both given: use one"


@front_rule("batch")
def global_batch(args: argparse.Namespace, world_size: int) -> Optional[str]:
    data_parallel = _data_parallel(args, world_size)
    per_step = args.micro_batch_size * data_parallel
    if args.global_batch_size % per_step:
        return (f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
                f"{args.micro_batch_size} x {data_parallel} workers = {per_step}: gradient accumulation "
                "needs a whole number of micro batches")


@front_rule("compile")
def pad_to_multiple_of(args: argparse.Namespace, world_size: int) -> Optional[str]:
    if args.pad_to_multiple_of is not None and args.pad_to_multiple_of < 1:
        return f"--pad-to-multiple-of {args.pad_to_multiple_of}: give a positive number of tokens (e.g. 64)"


@front_rule("pretraining")
def blackbox_pretraining_settings(args: argparse.Namespace, world_size: int) -> Optional[str]:
    """--task pretraining trains the Hugging Face model directory: what its PreTrainer would refuse in every
    worker is refused here, before any worker starts."""
    if args.task != "pretraining" or args.user_script:
        return None
    if args.num_experts:
        return (f"--num-experts {args.num_experts}: --task pretraining trains the Hugging Face model in "
                "--pretrained-model-name-or-path, whose config says whether it has experts; mixture-of-"
                "experts layers are built in Megatron models (a --user-script PreTrainer whose model is "
                "megatron_patch.models.GPTModel()): drop the flag")
    from megatron_patch.config import ConfigError
    from ..engine_config import engine_config

    try:  # the settings PreTrainer.train() validates first (the run's shape, schedule and data)
        engine_config(args, accelerations=False).validate(world_size)
    except ConfigError as e:
        return str(e)


@front_rule("accelerations")
def padding_free_task(args: argparse.Namespace, world_size: int) -> Optional[str]:
    if not getattr(args, "padding_free", False) or args.task not in FINETUNE_TASKS or args.task in PADDING_FREE_TASKS:
        return None  # pretraining: refused as a fine-tuning flag (flag_use); a script without --task: its template
    return (f"--padding-free with --task {args.task}: packed rows have adapters for "
            f"{' and '.join(PADDING_FREE_TASKS)} (a BERT-family encoder's per-sample or per-token loss); "
            f"{args.task} trains on padded batches: drop --padding-free")


@front_rule("accelerations")
def switch_combination(args: argparse.Namespace, world_size: int) -> Optional[str]:
    from megatron_patch.accelerations import check_combination

    try:
        check_combination(args)
    except ValueError as e:
        return str(e)


def check(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Apply the front end's rules to parsed flags for a run of `world_size` workers (see module docstring)."""
    # the launch rules first: they need no defaults and import nothing, so a missing flag is reported at once
    run_front(args, world_size, lambda concern: concern == "launch", UsageError)
    resolve_front(args, world_size)
    # the rest of the command line's rules; those of the script's PreTrainer and model run where they are known
    run_front(args, world_size, lambda concern: concern != "launch" and concern not in MODEL_CONCERNS, UsageError)
    # last, so the specific refusals above speak first; what the model decides: preflight and the templates
    refuse_unused(args, run_kinds(args))
    return args
