"""The `rapidformer` command line: every flag of the Rapidformer parameter guide, with its defaults.

The front end has its own rules (`check`), separate from the Megatron engine's `validate()`: the how-to's
commands omit flags the guide marks required (`--save`, `--train-iters` with `--epochs`), and they still
run, with the default named in one log line. Impossible combinations are refused here, before any worker
starts, in a sentence that names the flags and the fix.
"""
from __future__ import annotations

import argparse
from typing import List, Optional

TASKS = ("sequence_classification", "token_classification", "question_answering", "masked_lm",
         "casual_lm", "causal_lm", "seq2seq_lm", "pretraining")
FINETUNE_TASKS = TASKS[:-1]


class UsageError(ValueError):
    """A command line the front end refuses; the message names the flags and the fix."""


def _bool(parser_group, *names: str, help: str) -> None:
    parser_group.add_argument(*names, action="store_true", help=help)


class _HelpWithDefaults(argparse.HelpFormatter):
    """Show a flag's default in --help when it has a real one (not None/False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


COMPILE_MODES = ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rapidformer", allow_abbrev=False, formatter_class=_HelpWithDefaults,
        description="Fine-tune or pretrain Transformers with switchable accelerations; nothing is downloaded "
                    "(models and data are local). Black-box fine-tuning: --task sequence_classification (or "
                    "another fine-tuning task) with --pretrained-model-name-or-path DIR and --data-path DIR of "
                    "train/validation files. Black-box pretraining: --task pretraining trains the Hugging Face "
                    "model in --pretrained-model-name-or-path DIR (BERT-style: masked LM + next-sentence prediction; "
                    "causal LMs: next token) for --train-iters iterations on a Megatron mmap corpus "
                    "(--data-path PREFIX from tools/preprocess_data.py) with its --tokenizer-type and --vocab-file; "
                    "shape flags (--num-layers, --hidden-size, ...) that differ from the directory's config start "
                    "a model of that shape from new weights. White box: --user-script FILE with a Finetuner or "
                    "PreTrainer subclass.")
    g = p.add_argument_group("launch")
    g.add_argument("--task", choices=TASKS, help="what to train. Fine-tuning a model directory on local files: "
                   "sequence_classification, token_classification, question_answering, masked_lm, causal_lm "
                   "(the guide's casual_lm), seq2seq_lm. pretraining: trains the model directory (its weights, "
                   "or new weights of the shape flags' shape) on a Megatron mmap corpus; needs "
                   "--pretrained-model-name-or-path, --data-path PREFIX, "
                   "--tokenizer-type, --vocab-file and --train-iters")
    g.add_argument("--user-script", help="a white-box script (a Finetuner or PreTrainer subclass) to run in every "
                   "worker")
    g.add_argument("--nproc-per-node", type=int, help="workers on this node (default: one per visible GPU, "
                   "CUDA_VISIBLE_DEVICES; 1 on a machine without GPU)")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", help="fine-tuning: a local directory of train/validation/test files (jsonl, json, "
                   "csv, parquet), a save_to_disk directory, or a dataset name in the local Hugging Face cache; "
                   "pretraining: the prefix of a Megatron mmap corpus (PREFIX.bin/.idx)")
    g.add_argument("--data-name", "--dataset-name", dest="data_name",
                   help="the dataset's configuration (e.g. mrpc): a subdirectory of --data-path (refused when "
                        "there is none)")
    g.add_argument("--data-dir", help="where the fine-tuning files are, as datasets' data_dir")
    g.add_argument("--text-columns", nargs="+", help="the input text column(s); found by their usual names otherwise")
    g.add_argument("--label-column", help="the label column; found by its usual name otherwise")
    g.add_argument("--micro-batch-size", type=int, help="batch size of each worker")
    g.add_argument("--global-batch-size", type=int, help="batch size of all workers together (iteration-based "
                   "runs accumulate gradients to reach it)")
    g.add_argument("--tokenizer-type", choices=["BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer"])
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    g.add_argument("--split", default="969,30,1", help="train,validation,test weights of a pretraining corpus")
    g.add_argument("--data-impl", default="mmap", choices=["lazy", "cached", "mmap", "infer"])
    g.add_argument("--data-iterator", choices=["dynamic-shape", "fixed-shape"],
                   help="dynamic-shape: pretraining only (the PreTrainer); fine-tuning pads each batch to its longest sample")
    g.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    g.add_argument("--pad-to-multiple-of", type=int, default=None,
                   help="pad each fine-tuning batch to a multiple of N tokens instead of exactly its longest sample "
                        "(fewer distinct shapes; default 64 with --torch-compile-mode reduce-overhead/max-autotune)")
    g.add_argument("--mask-prob", type=float, default=0.15)
    g.add_argument("--short-seq-prob", type=float, default=0.1)
    _bool(g, "--mmap-warmup", help="read the whole mmap corpus once at start")
    _bool(g, "--eod-mask-loss", help="pretraining: no loss on end-of-document tokens")
    _bool(g, "--reset-position-ids", help="pretraining: positions restart after each end-of-document token")
    _bool(g, "--reset-attention-mask", help="pretraining: attend within documents only (not supported: refused)")
    g.add_argument("--data-cache-path", help="pretraining: where megatron-core's dataset index caches go "
                   "(default: next to the data)")

    g = p.add_argument_group("model")
    g.add_argument("--pretrained-model-name-or-path", help="a local Hugging Face model directory (or a name already "
                   "in the local cache: nothing is downloaded)")
    shape = ("Megatron models and --task pretraining: the model's shape; a Hugging Face model loaded as it is "
             "must agree with its config (a difference is refused)")
    g.add_argument("--num-layers", type=int, help=shape)
    g.add_argument("--hidden-size", type=int, help=shape)
    g.add_argument("--num-attention-heads", type=int, help=shape)
    g.add_argument("--max-position-embeddings", type=int, help=shape)
    g.add_argument("--seq-length", type=int, help="fine-tuning: the longest tokenized input (default: the "
                   "model's maximum, at most 512)")
    g.add_argument("--num-experts", type=int)
    g.add_argument("--ffn-hidden-size", type=int, help="MLP width (default 4 x hidden size); " + shape)
    hf_setting = ("; a Hugging Face model the black-box tasks load gets it in its config ({}); one a script "
                  "builds must have it there")
    g.add_argument("--hidden-dropout", type=float, help="Megatron models (default 0.1)"
                   + hf_setting.format("hidden_dropout_prob, resid_pdrop/embd_pdrop, dropout ..."))
    g.add_argument("--attention-dropout", type=float, help="Megatron models (default 0.1)"
                   + hf_setting.format("attention_probs_dropout_prob, attn_pdrop, attention_dropout ..."))
    g.add_argument("--init-method-std", type=float, help="Megatron models: std of the normal weight init (0.02)"
                   + hf_setting.format("initializer_range: the weights the directory does not hold, e.g. a new "
                                       "classification head"))
    g.add_argument("--make-vocab-size-divisible-by", type=int, help="Megatron models: pad the vocabulary (128); "
                   "refused for Hugging Face models (their config gives the vocabulary)")

    g = p.add_argument_group("training")
    g.add_argument("--save", help="where the trained model is saved (save_pretrained; fine-tuning: with its "
                   "tokenizer; pretraining: also the checkpoints --load resumes from)")
    g.add_argument("--load", help="the weights a template loads (Hugging Face templates: defaults to "
                   "--pretrained-model-name-or-path)")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear", choices=["constant", "linear", "cosine"])
    g.add_argument("--lr-decay-iters", type=int, help="iterations of the decay (default: all of training)")
    g.add_argument("--lr-warmup-fraction", type=float)
    g.add_argument("--lr-warmup-iters", type=int)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--train-iters", type=int, help="optimizer steps (iteration-based run; pretraining needs it)")
    g.add_argument("--epochs", type=int, help="passes over the training set (epoch-based fine-tuning)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=100, help="log a training line every N steps")
    g.add_argument("--eval-interval", type=int, default=1000, help="pretraining: validate every N iterations; "
                   "fine-tuning (when given): also evaluate every N optimizer steps, besides after every epoch")
    g.add_argument("--eval-iters", type=int, default=10, help="pretraining: validation batches per evaluation "
                   "(fine-tuning evaluates the whole validation split)")
    g.add_argument("--save-interval", type=int, help="pretraining: write a checkpoint to --save every N iterations "
                   "(and at the end); --load DIR resumes from it")
    _bool(g, "--override-opt-param-scheduler", help="pretraining, resuming with --load: continue from the "
          "checkpoint's step with this run's learning-rate schedule flags where they differ from the checkpoint's "
          "(--lr, --min-lr, --lr-decay-*, warmup, --weight-decay, --train-iters: refused otherwise)")
    _bool(g, "--use-checkpoint-opt-param-scheduler", help="pretraining, resuming with --load: keep the "
          "checkpoint's learning-rate schedule, whatever this run's schedule flags say")
    _bool(g, "--eval-at-start", help="also evaluate before training (reported as epoch 0)")
    g.add_argument("--metrics-file", help="append one JSON line per evaluation (default: SAVE/metrics.jsonl)")
    g.add_argument("--tensorboard-dir", help="TensorBoard logs (default: SAVE/tensorboard)")

    g = p.add_argument_group("accelerations")
    _bool(g, "--mixed-precision", help="fp16 autocast with dynamic loss scaling")
    _bool(g, "--bf16", help="bf16 autocast (no loss scaling needed)")
    _bool(g, "--zero-1-memory-optimization", help="ZeRO-1: optimizer state sharded across workers")
    _bool(g, "--zero-2-memory-optimization", help="ZeRO-2: optimizer state and gradients sharded")
    _bool(g, "--zero-3-memory-optimization", help="ZeRO-3: optimizer state, gradients and parameters sharded")
    _bool(g, "--oss-memory-optimization", help="OSS: optimizer state sharded")
    _bool(g, "--oss-sdp-memory-optimization", help="SDP: optimizer state and gradients sharded")
    _bool(g, "--fsdp-memory-optimization", help="FSDP: optimizer state, gradients and parameters sharded")
    _bool(g, "--cpu-offload", help="optimizer state and step on the CPU")
    _bool(g, "--checkpoint-activations", help="recompute activations in the backward pass")
    g.add_argument("--optimizers", default="apex_adam", choices=["apex_adam", "apex_lamb"],
                   help="apex's fused Adam/LAMB when apex is installed, else torch's fused AdamW / our LAMB")
    g.add_argument("--torch-compile", "--compile", dest="torch_compile", action="store_true",
                   help="compile the model with torch.compile")
    g.add_argument("--torch-compile-mode", "--compile-mode", dest="torch_compile_mode", default=None, choices=COMPILE_MODES,
                   help="torch.compile's mode (implies --torch-compile); reduce-overhead and max-autotune replay "
                        "each step's kernels as CUDA graphs (GPU only), for batches padded to --pad-to-multiple-of")
    _bool(g, "--onnx-runtime-training", help="train through ONNX Runtime's ORTModule (optional extra)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Megatron pretraining only")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Megatron pretraining only")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int,
                   help="Megatron pretraining: interleaved pipeline schedule")
    return p


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
