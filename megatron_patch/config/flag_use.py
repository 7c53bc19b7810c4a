"""Which `rapidformer` flag acts in which kind of run, and the refusal of a flag given where nothing reads it.

A flag accepted and then ignored is worse than an error: the user believes it changed the run. `TABLE` says,
for every flag of `build_parser()` and every kind of run, what happens to it; `tests/test_rapidformer_flags.py`
checks that it names every flag, so a new flag must be placed here. The kinds of run:

    ft         black-box fine-tuning: --task sequence_classification ... (a Finetuner that needs no code)
    finetuner  a white-box Finetuner script (--user-script; --task of a fine-tuning kind declares one)
    pt         black-box --task pretraining of a Hugging Face model directory
    hf         a white-box PreTrainer whose model is a Hugging Face/PyTorch model
    mg         a white-box PreTrainer whose model is a Megatron model (megatron_patch.models.GPTModel(): the engine)

What a cell says:

    acts       the front end, the template or the engine reads it
    config     a Hugging Face model keeps the shape and settings of its config: the flag must agree with it
               (templates/rules/shape_flags.py refuses a difference)
    script     the template does not read it; the white-box script's hooks get it from get_args() (the
               documented samples pass --split, --data-impl, --mask-prob ... to the dataset builders)
    no         refused when given
    masked_lm, labelled, bert, causal, dynamic, gpt2bpe
               acts only in such a run (--task masked_lm; a task with labels; a BERT-style or causal model
               directory; --data-iterator dynamic-shape; --tokenizer-type GPT2BPETokenizer), refused otherwise

A white-box script's own loop (`engine.compose`, no template) reads what it reads: only `compose` (the
acceleration, optimizer and schedule flags) and `build_data_loader` act for it, and nothing is refused there
beyond what is refused everywhere.

The refusals run where the kind of run is first known: the front end's rules (templates/rules/) for --task runs,
before any worker starts; the launching process's model check (cli/preflight.py) for what depends on the model
directory's config; the templates' train() for a --user-script, whose kind only the template knows.
"""
from __future__ import annotations

import argparse
from typing import Dict, FrozenSet, Iterable, List, Optional, Tuple

from .rapidformer_flags import FINETUNE_TASKS, UsageError, given_flags

KINDS = ("ft", "finetuner", "pt", "hf", "mg")

TABLE_TEXT = """
flag                                   ft         finetuner  pt         hf         mg
task                                   acts       acts       acts       acts       acts
user_script                            acts       acts       acts       acts       acts
nproc_per_node                         acts       acts       acts       acts       acts
max_restarts                           no         no         acts       acts       acts
data_path                              acts       script     acts       script     script
data_name                              acts       script     no         script     script
data_dir                               acts       script     no         script     script
text_columns                           acts       script     no         script     script
label_column                           labelled   script     no         script     script
micro_batch_size                       acts       acts       acts       acts       acts
global_batch_size                      acts       acts       acts       acts       acts
tokenizer_type                         no         script     acts       script     acts
vocab_file                             no         script     acts       script     acts
merge_file                             no         script     gpt2bpe    gpt2bpe    gpt2bpe
split                                  no         script     acts       script     script
data_impl                              no         script     acts       script     script
data_iterator                          no         no         acts       acts       acts
num_workers                            acts       acts       acts       acts       acts
pad_to_multiple_of                     acts       acts       dynamic    dynamic    no
mask_prob                              masked_lm  script     bert       script     script
short_seq_prob                         no         script     bert       script     script
mmap_warmup                            no         script     acts       script     script
eod_mask_loss                          no         script     causal     script     script
reset_position_ids                     no         script     causal     script     script
reset_attention_mask                   no         no         no         no         no
data_cache_path                        no         script     acts       script     script
pretrained_model_name_or_path          acts       acts       acts       script     script
num_layers                             config     config     acts       config     acts
hidden_size                            config     config     acts       config     acts
num_attention_heads                    config     config     acts       config     acts
max_position_embeddings                config     config     acts       config     acts
seq_length                             acts       script     acts       acts       acts
num_experts                            no         no         no         no         acts
ffn_hidden_size                        config     config     acts       config     acts
hidden_dropout                         acts       config     acts       config     acts
attention_dropout                      acts       config     acts       config     acts
init_method_std                        acts       config     acts       config     acts
make_vocab_size_divisible_by           no         no         no         no         acts
save                                   acts       acts       acts       acts       acts
load                                   acts       script     acts       acts       acts
lr                                     acts       acts       acts       acts       acts
min_lr                                 acts       acts       acts       acts       acts
lr_decay_style                         acts       acts       acts       acts       acts
lr_decay_iters                         acts       acts       acts       acts       acts
lr_warmup_fraction                     acts       acts       acts       acts       acts
lr_warmup_iters                        acts       acts       acts       acts       acts
weight_decay                           acts       acts       acts       acts       acts
clip_grad                              acts       acts       acts       acts       acts
adam_beta1                             acts       acts       acts       acts       acts
adam_beta2                             acts       acts       acts       acts       acts
adam_eps                               acts       acts       acts       acts       acts
train_iters                            acts       acts       acts       acts       acts
epochs                                 acts       acts       no         no         no
seed                                   acts       acts       acts       acts       acts
log_interval                           acts       acts       acts       acts       acts
eval_interval                          acts       acts       acts       acts       acts
eval_iters                             no         no         acts       acts       acts
save_interval                          no         no         acts       acts       acts
override_opt_param_scheduler           no         no         acts       acts       acts
use_checkpoint_opt_param_scheduler     no         no         acts       acts       acts
eval_at_start                          acts       acts       no         no         no
metrics_file                           acts       acts       acts       acts       acts
tensorboard_dir                        acts       acts       acts       acts       acts
mixed_precision                        acts       acts       acts       acts       acts
bf16                                   acts       acts       acts       acts       acts
zero_1_memory_optimization             acts       acts       acts       acts       acts
zero_2_memory_optimization             acts       acts       acts       acts       acts
zero_3_memory_optimization             acts       acts       acts       acts       no
oss_memory_optimization                acts       acts       acts       acts       no
oss_sdp_memory_optimization            acts       acts       acts       acts       no
fsdp_memory_optimization               acts       acts       acts       acts       no
cpu_offload                            acts       acts       acts       acts       acts
checkpoint_activations                 acts       acts       acts       acts       acts
optimizers                             acts       acts       acts       acts       acts
torch_compile                          acts       acts       acts       acts       acts
torch_compile_mode                     acts       acts       acts       acts       acts
onnx_runtime_training                  acts       acts       acts       acts       no
padding_free                           acts       acts       no         no         no
tensor_model_parallel_size             no         no         no         no         acts
pipeline_model_parallel_size           no         no         no         no         acts
num_layers_per_virtual_pipeline_stage  no         no         no         no         acts
lora_rank                              acts       acts       acts       acts       no
lora_alpha                             acts       acts       acts       acts       no
lora_dropout                           acts       acts       acts       acts       no
lora_target                            acts       acts       acts       acts       no
"""


def _parse(text: str) -> Dict[str, Dict[str, str]]:
    rows = [line.split() for line in text.strip().splitlines()]
    assert tuple(rows[0][1:]) == KINDS, rows[0]
    return {row[0]: dict(zip(KINDS, row[1:], strict=True)) for row in rows[1:]}


TABLE: Dict[str, Dict[str, str]] = _parse(TABLE_TEXT)
PLAIN = ("acts", "config", "script", "no")
MODEL_TRAITS = ("bert", "causal")  # known only once the model directory's config is read
TRAITS = ("masked_lm", "labelled", "dynamic", "gpt2bpe") + MODEL_TRAITS

# What a flag is for, said when it is refused (with what the run does instead, where that helps)
PURPOSE: Dict[str, str] = {
    "data_name": "a fine-tuning dataset's configuration (a subdirectory of --data-path); pretraining reads the "
                 "mmap corpus at the --data-path prefix",
    "data_dir": "where fine-tuning files are; pretraining reads the mmap corpus at the --data-path prefix",
    "text_columns": "the text columns of fine-tuning files; a pretraining corpus is tokenized already",
    "label_column": "the label column of a fine-tuning task with labels; masked_lm and causal_lm learn from the "
                    "text alone, and a pretraining corpus has no labels",
    "tokenizer_type": "the tokenizer of a Megatron pretraining corpus; fine-tuning tokenizes with the tokenizer in "
                      "the model directory",
    "vocab_file": "the vocabulary of --tokenizer-type for a pretraining corpus; fine-tuning tokenizes with the "
                  "tokenizer in the model directory",
    "merge_file": "the BPE merges of --tokenizer-type GPT2BPETokenizer (WordPiece tokenizers and fine-tuning's "
                  "model-directory tokenizer have none)",
    "split": "the train,validation,test weights of a pretraining corpus; fine-tuning reads the train/validation/"
             "test files of --data-path",
    "data_impl": "how a pretraining corpus (.bin/.idx) is read; fine-tuning reads jsonl/json/csv/parquet files",
    "data_iterator": "pretraining's choice of batch shapes (the PreTrainer); fine-tuning pads each batch to its "
                     "longest sample (--pad-to-multiple-of for fewer shapes)",
    "pad_to_multiple_of": "pads each padded batch to a multiple of N tokens (fine-tuning batches, pretraining's "
                          "--data-iterator dynamic-shape); fixed-shape pretraining samples are --seq-length long "
                          "already",
    "mask_prob": "the share of tokens masked for masked-LM training (--task masked_lm, BERT-style pretraining)",
    "short_seq_prob": "how often BERT pretraining samples are cut short",
    "mmap_warmup": "reads a pretraining corpus (.bin) once at start",
    "eod_mask_loss": "no loss on the end-of-document tokens of causal-LM pretraining documents (BERT sentence "
                     "pairs and fine-tuning samples have none)",
    "reset_position_ids": "positions restart after each end-of-document token of causal-LM pretraining documents "
                          "(BERT sentence pairs and fine-tuning samples have none)",
    "reset_attention_mask": "attention within documents only, which is not supported (the engine's SDPA attention "
                            "runs one causal mask over the packed sequence; --reset-position-ids still restarts "
                            "positions at each document)",
    "data_cache_path": "where megatron-core's index caches of a pretraining corpus go",
    "num_experts": "mixture-of-experts layers, built in Megatron models (a PreTrainer script whose model is "
                   "megatron_patch.models.GPTModel()); a Hugging Face model's config says whether it has experts",
    "make_vocab_size_divisible_by": "pads a Megatron model's vocabulary; a Hugging Face model's vocabulary is its "
                                    "config's vocab_size",
    "epochs": "passes over a fine-tuning training set; pretraining runs --train-iters iterations",
    "eval_iters": "validation batches per pretraining evaluation; fine-tuning evaluates the whole validation "
                  "split (--eval-interval N also evaluates every N steps)",
    "override_opt_param_scheduler": "resuming a pretraining checkpoint (--load) with a changed learning-rate "
                                    "schedule; fine-tuning resumes nothing, its schedule starts with the run",
    "use_checkpoint_opt_param_scheduler": "resuming a pretraining checkpoint (--load) on the checkpoint's "
                                          "learning-rate schedule; fine-tuning resumes nothing, its schedule starts "
                                          "with the run",
    "max_restarts": "pretraining: a job whose worker died starts again and resumes from the newest checkpoint of "
                    "--save; fine-tuning keeps no checkpoint mid-run to resume from",
    "save_interval": "pretraining checkpoints every N iterations, which --load resumes; fine-tuning saves the "
                     "trained model to --save once, at the end (save_pretrained)",
    "eval_at_start": "fine-tuning's evaluation of the untrained model; pretraining validates every --eval-interval "
                     "iterations",
    "zero_3_memory_optimization": "ZeRO-3 for Hugging Face models; a Megatron model is sharded with "
                                  "--zero-1-memory-optimization or --zero-2-memory-optimization",
    "oss_memory_optimization": "OSS for Hugging Face models; a Megatron model is sharded with "
                               "--zero-1-memory-optimization",
    "oss_sdp_memory_optimization": "SDP for Hugging Face models; a Megatron model is sharded with "
                                   "--zero-2-memory-optimization",
    "fsdp_memory_optimization": "FSDP for Hugging Face models; a Megatron model is sharded with "
                                "--zero-2-memory-optimization",
    "padding_free": "fine-tuning a Hugging Face encoder on packed rows of samples (--task sequence_classification "
                    "or token_classification, or a Finetuner script); pretraining packs its own way (GPT samples are "
                    "packed, --data-iterator dynamic-shape cuts BERT batches to their longest sample)",
    "onnx_runtime_training": "ONNX Runtime's ORTModule for Hugging Face/PyTorch models; a Megatron model uses "
                             "--torch-compile",
    "tensor_model_parallel_size": "tensor and pipeline parallelism are for Megatron models (a PreTrainer script "
                                  "whose model is megatron_patch.models.GPTModel()); a Hugging Face model is "
                                  "trained data parallel (--zero-3-memory-optimization shards it)",
    "pipeline_model_parallel_size": "tensor and pipeline parallelism are for Megatron models (a PreTrainer script "
                                    "whose model is megatron_patch.models.GPTModel()); a Hugging Face model is "
                                    "trained data parallel (--zero-3-memory-optimization shards it)",
    "num_layers_per_virtual_pipeline_stage": "the interleaved pipeline schedule of a Megatron model",
    **{k: "LoRA adapters on a Hugging Face model (peft); a Megatron model's LoRA is the engine's: "
          "pretrain_scripts/run_sft.sh or pretrain_megatron_gpt.py --lora-rank"
       for k in ("lora_rank", "lora_alpha", "lora_dropout", "lora_target")},
}
# a value that leaves the run as it is: given explicitly, it is not refused
NEUTRAL = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}

WHO = {"ft": "black-box fine-tuning (--task {task})", "finetuner": "a Finetuner script",
       "pt": "--task pretraining", "hf": "a PreTrainer with a Hugging Face model",
       "mg": "a PreTrainer with a Megatron model (the engine)"}


def traits(args: argparse.Namespace, model_kind: Optional[str] = None) -> FrozenSet[str]:
    """The conditions the conditional cells test, from the flags (and the model directory's kind, 'bert' or
    'causal', when known). Without --tokenizer-type the tokenizer is not known: --merge-file is let through."""
    out = set()
    if args.task == "masked_lm":
        out.add("masked_lm")
    if args.task in FINETUNE_TASKS and args.task not in ("masked_lm", "causal_lm", "casual_lm"):
        out.add("labelled")
    if getattr(args, "data_iterator", None) == "dynamic-shape":
        out.add("dynamic")
    if getattr(args, "tokenizer_type", None) in (None, "GPT2BPETokenizer"):
        out.add("gpt2bpe")
    if model_kind:
        out.add(model_kind)
    return frozenset(out)


def _unused_in(cell: str, have: FrozenSet[str], model_known: bool) -> bool:
    if cell == "no":
        return True
    if cell in PLAIN:
        return False
    if cell in MODEL_TRAITS and not model_known:
        return False  # decided once the model directory's config is read
    return cell not in have


def unused(args: argparse.Namespace, kinds: Iterable[str], model_kind: Optional[str] = None) -> List[str]:
    """The dests given on the command line that no run of `kinds` reads (a flag is refused only when it is
    unused in every kind the run may be: a --user-script may be a Finetuner or a PreTrainer)."""
    kinds = tuple(kinds)
    have = traits(args, model_kind)
    given = given_flags(args)
    out = []
    for dest, cells in TABLE.items():
        if dest not in given or NEUTRAL.get(dest, object()) == getattr(args, dest, None):
            continue
        if all(_unused_in(cells[k], have, model_kind is not None) for k in kinds):
            out.append(dest)
    return out


def _shown(args: argparse.Namespace, dest: str) -> str:
    value = getattr(args, dest, None)
    flag = "--" + dest.replace("_", "-")
    if value is True or value is None:
        return flag
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, (list, tuple)) else value}"


def refusal(args: argparse.Namespace, dests: List[str], who: str) -> str:
    """One line: each flag with what it is for, the run that does not use it, and the fix."""
    parts = [f"{_shown(args, d)}: {PURPOSE[d]}" for d in dests]
    if len(parts) == 1:
        return f"{parts[0]}. {who} does not use it: drop it"
    return "; ".join(parts) + f". {who} uses none of them: drop them"


def who(args: argparse.Namespace, kinds: Iterable[str], model_kind: Optional[str] = None) -> str:
    kinds = tuple(kinds)
    if set(kinds) == {"hf", "mg"}:
        text = "a PreTrainer script"
    elif set(kinds) == {"finetuner", "hf", "mg"}:
        text = "a Finetuner or PreTrainer script"
    else:
        text = " or ".join(WHO[k].format(task=args.task) for k in kinds)
    if model_kind:
        text += f" of a {'BERT-style model' if model_kind == 'bert' else 'causal LM'}"
    return text[0].upper() + text[1:]


def refuse_unused(args: argparse.Namespace, kinds: Iterable[str], model_kind: Optional[str] = None,
                  error: type = UsageError) -> None:
    """Raise `error` (one line) when a flag given is unused by every run of `kinds` (see the module docstring)."""
    kinds = tuple(kinds)
    dests = unused(args, kinds, model_kind)
    if dests:
        raise error(refusal(args, dests, who(args, kinds, model_kind)))


def run_kinds(args: argparse.Namespace) -> Tuple[str, ...]:
    """The kinds a run may be, from the flags alone: one for --task runs, several for a --user-script (its
    template says which when it starts)."""
    if not args.user_script:
        if args.task in FINETUNE_TASKS:
            return ("ft",)
        return ("pt",) if args.task == "pretraining" else ()
    if args.task in FINETUNE_TASKS:
        return ("finetuner",)
    if args.task == "pretraining":
        return ("hf", "mg")
    return ("finetuner", "hf", "mg")
