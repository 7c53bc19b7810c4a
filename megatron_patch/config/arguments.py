"""Command-line flags (Megatron-LM / Rapidformer names) -> `Config`."""
from __future__ import annotations

import argparse
import ast
from typing import List, Optional, Union

from .config import Config, ConfigError
from . import hf_source, model_source
from .presets import FAMILIES, SIZES, preset

_D = Config()  # defaults shown in --help


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError for a bad flag instead of printing usage and exiting: the entry point
    then reports it like any other configuration error (once, not once per torchrun worker)."""

    def error(self, message: str):
        raise ConfigError(f"{message} (--help lists every flag)")


# BERT-only settings -> their flags (refused by the GPT entry point, which has no use for them)
BERT_FLAGS = {"bert_binary_head": "--bert-no-binary-head", "mask_prob": "--mask-prob",
              "short_seq_prob": "--short-seq-prob"}
MODELS = {"gpt": "a GPT/Llama-family model", "bert": "a BERT model (masked LM + next-sentence prediction)"}


def moe_layer_freq(text: str) -> Union[int, List[int]]:
    """--moe-layer-freq as Megatron-LM takes it: N (every N-th layer has experts) or a 0/1 list per layer,
    written out ("[0,1,1,1]") or as Megatron-LM's list expression ("([0]+[1]*3)*2"). The expression is
    evaluated over int/list literals, + and * only (Megatron-LM calls eval; here nothing else runs)."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError
    try:
        out = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        out = None
    if not (type(out) is int or (isinstance(out, list) and all(type(x) is int for x in out))):
        raise argparse.ArgumentTypeError(f"{text!r} is neither N nor a list of 0/1 per layer such as [0,1,1,1] or "
                                         f"([0]+[1]*3)*2")
    return out


def build_parser(model: str = "gpt") -> argparse.ArgumentParser:
    p = _Parser(
        description=f"Pretrain {MODELS[model]} with megatron-core (TP/PP/DP, ZeRO-1, bf16/fp16).",
        argument_default=argparse.SUPPRESS,  # only flags given on the command line override presets/defaults
        allow_abbrev=False,
    )
    g = p.add_argument_group("model")
    g.add_argument("--model-family", choices=list(FAMILIES),
                   help="architecture preset: gpt (GPT-2), llama, qwen2, mistral, mixtral, qwen2_moe; "
                   "bert (pretrain_megatron_bert.py)")
    g.add_argument("--model-size", help="size preset of the family: " + "; ".join(f"{f}: {', '.join(s)}" for f, s in SIZES.items()))
    for name, typ in [("num-layers", int), ("hidden-size", int), ("num-attention-heads", int), ("num-query-groups", int),
                      ("ffn-hidden-size", int), ("kv-channels", int), ("seq-length", int), ("max-position-embeddings", int), ("rotary-base", int),
                      ("norm-epsilon", float), ("hidden-dropout", float), ("attention-dropout", float),
                      ("init-method-std", float), ("make-vocab-size-divisible-by", int), ("vocab-size", int)]:
        g.add_argument(f"--{name}", type=typ, help=f"(default {getattr(_D, name.replace('-', '_'))})")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"])
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--attention-backend", choices=["auto", "sdpa", "local", "te"],
                   help="core attention: auto (Transformer Engine spec when installed, else sdpa), sdpa (torch "
                        "scaled_dot_product_attention: flash/cuDNN kernels on GPU), local (megatron-core's unfused), te")
    g.add_argument("--init-layout-invariant", action="store_true",
                   help="seed every weight from its global name so any TP/PP layout starts from identical weights "
                        "(slower start-up; used by the parallel tests)")
    for name in ("swiglu", "openai-gelu", "untie-embeddings-and-output-weights", "disable-bias-linear", "add-qkv-bias"):
        g.add_argument(f"--{name}", action="store_true")

    g = p.add_argument_group("mixture of experts (megatron-core MoELayer)")
    g.add_argument("--num-experts", type=int, help="experts per MoE layer (default: a dense MLP)")
    for name, typ in [("moe-router-topk", int), ("moe-ffn-hidden-size", int), ("moe-layer-freq", moe_layer_freq),
                      ("moe-shared-expert-intermediate-size", int), ("moe-aux-loss-coeff", float), ("moe-z-loss-coeff", float), ("moe-expert-capacity-factor", float),
                      ("expert-model-parallel-size", int), ("expert-tensor-parallel-size", int)]:
        g.add_argument(f"--{name}", type=typ, help=f"(default {getattr(_D, name.replace('-', '_'))})")
    g.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"])
    g.add_argument("--moe-token-dispatcher-type", choices=["alltoall", "allgather"])
    g.add_argument("--moe-token-drop-policy", choices=["probs", "position"])
    for name in ("moe-router-pre-softmax", "moe-pad-expert-input-to-capacity", "moe-per-layer-logging"):
        g.add_argument(f"--{name}", action="store_true")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="scale the shared expert's output by a sigmoid gate (Qwen2-MoE)")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="run each MoE layer's experts as two grouped GEMMs (torch._grouped_mm) instead of a GEMM pair "
                        "per expert; same parameters and checkpoints (expert tensor parallel size 1, not with ZeRO-2)")

    g = p.add_argument_group("BERT (pretrain_megatron_bert.py)")
    g.add_argument("--bert-no-binary-head", dest="bert_binary_head", action="store_false",
                   help="masked LM only: no pooler, next-sentence head or loss (the data then needs no sentence pairs)")
    g.add_argument("--mask-prob", type=float, help=f"share of tokens to predict (default {_D.mask_prob})")
    g.add_argument("--short-seq-prob", type=float,
                   help=f"share of samples made shorter than --seq-length (default {_D.short_seq_prob})")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", help="prefix, or 'weight prefix weight prefix ...' to blend")
    g.add_argument("--mock-data", action="store_true", help="random tokens (tests and benchmarks)")
    g.add_argument("--split", help=f"train,valid,test weights (default {_D.split})")
    g.add_argument("--tokenizer-type", help="GPT2BPETokenizer, SentencePieceTokenizer, HuggingFaceTokenizer, NullTokenizer, ...")
    g.add_argument("--vocab-file", "--vocab", dest="vocab_file")
    g.add_argument("--merge-file")
    g.add_argument("--tokenizer-model")
    g.add_argument("--data-impl", choices=["mmap", "cached", "lazy", "infer"])
    g.add_argument("--data-iterator", choices=["fixed-shape", "dynamic-shape"])
    g.add_argument("--data-cache-path")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--num-workers", type=int)

    g = p.add_argument_group("training")
    for name, typ in [("micro-batch-size", int), ("global-batch-size", int), ("train-iters", int), ("lr", float),
                      ("min-lr", float), ("lr-warmup-iters", int), ("lr-warmup-fraction", float), ("lr-decay-iters", int),
                      ("weight-decay", float), ("clip-grad", float), ("adam-beta1", float), ("adam-beta2", float),
                      ("adam-eps", float), ("seed", int), ("log-interval", int), ("eval-interval", int),
                      ("eval-iters", int), ("save-interval", int)]:
        g.add_argument(f"--{name}", type=typ, help=f"(default {getattr(_D, name.replace('-', '_'))})")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"])
    g.add_argument("--optimizers", choices=["apex_adam", "apex_lamb"], help="fused Adam (default) or LAMB")
    g.add_argument("--save")
    g.add_argument("--load")
    g.add_argument("--load-hf", metavar="DIR",
                   help="start from a Hugging Face model directory (config.json + safetensors; GPT-2, Llama, Qwen2, "
                        "Mistral, Mixtral, Qwen2-MoE): architecture from its config, weights loaded into any "
                        "TP/PP/EP layout")
    g.add_argument("--tensorboard-dir")
    g.add_argument("--no-exit-on-nan", dest="exit_on_nan", action="store_false", help="keep going after a NaN/Inf loss")
    g.add_argument("--metrics-file", help="append one JSON line of metrics per iteration to this file (rank 0)")
    g.add_argument("--exit-interval", type=int, help="stop (after saving) when the iteration is a multiple of this")
    g.add_argument("--skip-train", action="store_true", help="only evaluate (validation and test sets), e.g. after --load")
    g.add_argument("--no-load-optim", action="store_true", help="with --load, take only the weights (fine-tuning)")
    g.add_argument("--override-opt-param-scheduler", action="store_true",
                   help="with --load: take this run's --lr, --min-lr, --lr-decay-iters/--train-iters, --lr-decay-style, "
                        "warmup and --weight-decay, continued from the checkpoint's step (by default a resume whose "
                        "schedule flags differ from the checkpoint's is refused)")
    g.add_argument("--use-checkpoint-opt-param-scheduler", action="store_true",
                   help="with --load: keep the checkpoint's learning-rate schedule whatever the flags say")
    g.add_argument("--keep-last-n", type=int, help="after each save, delete all but the newest N complete checkpoints")
    g.add_argument("--compile", "--torch-compile", dest="compile", action="store_true",
                   help="torch.compile each transformer layer (GPU; the attention only in MoE layers)")
    g.add_argument("--compile-mode", "--torch-compile-mode", dest="compile_mode", choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
                   help="torch.compile's mode with --compile; reduce-overhead replays each compiled layer as a CUDA "
                        f"graph (less host overhead for small models, more memory) (default {_D.compile_mode})")
    g.add_argument("--profile", action="store_true",
                   help="torch.profiler over iterations (--profile-step-start, --profile-step-end]: Chrome trace and a "
                        "GPU-time breakdown (matmul, attention, loss, optimizer, idle) in --profile-dir")
    g.add_argument("--profile-step-start", type=int, help=f"(default {_D.profile_step_start})")
    g.add_argument("--profile-step-end", type=int, help=f"(default {_D.profile_step_end})")
    g.add_argument("--profile-dir", help=f"(default {_D.profile_dir})")
    g.add_argument("--validate-only", action="store_true",
                   help="check the configuration for WORLD_SIZE processes (default 1) and the data, print the resolved "
                        "settings and exit: 0 when sound, 2 with the reason otherwise (the launchers run this "
                        "before torchrun)")

    g = p.add_argument_group("parallelism and acceleration switches")
    g.add_argument("--tensor-model-parallel-size", type=int)
    g.add_argument("--pipeline-model-parallel-size", type=int)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    for name in ("sequence-parallel", "zero-1-memory-optimization", "zero-2-memory-optimization",
                 "zero-3-memory-optimization", "bf16", "fp16", "mixed-precision", "checkpoint-activations", "cpu-offload"):
        g.add_argument(f"--{name}", action="store_true")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16: accumulate and reduce gradients in bf16 instead of fp32 (Megatron-LM's flag): "
                        "half the gradient buffer and its traffic, coarser accumulation over micro batches")
    g.add_argument("--gradient-accumulation-fusion", action="store_true",
                   help="linear layers accumulate their weight gradients straight into the gradient buffer (one "
                        "GEMM per weight and micro batch, no separate add; Megatron-LM's default with apex)")
    g.add_argument("--optimizer-step-fusion", action="store_true",
                   help="with --bf16: the Adam step in one Triton kernel (one launch per param group) that reads the "
                        "gradient buffer, clips, updates the fp32 weights and moments and writes the bf16 weights (no "
                        "fp32 gradient copies, one pass instead of four; GPU, or TRITON_INTERPRET=1 on the CPU)")
    g.add_argument("--loss-scale", type=float, help="static loss scale for fp16 (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float)
    g.add_argument("--min-loss-scale", type=float, help=f"dynamic scaling never goes below this (default {_D.min_loss_scale:g})")
    g.add_argument("--loss-scale-window", type=float,
                   help=f"clean steps before the dynamic loss scale doubles (default {_D.loss_scale_window:g})")
    g.add_argument("--hysteresis", type=int,
                   help=f"overflowing steps tolerated before the dynamic loss scale halves (default {_D.hysteresis})")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="fused loss (Megatron-LM's flag; GPT/Llama families): see --cross-entropy-fusion-impl")
    g.add_argument("--cross-entropy-fusion-impl", choices=["native", "te", "linear", "triton"],
                   help="with --cross-entropy-loss-fusion: native (default; megatron-core's fused softmax cross "
                        "entropy of the logits), te (Transformer Engine's), linear (output layer and cross entropy "
                        "fused, a chunk of tokens at a time: the full logits never exist; less memory), triton "
                        "(Triton kernels over the logits: one read forward, the gradient written over the logits; "
                        "needs a GPU, or TRITON_INTERPRET=1 on the CPU)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"])
    g.add_argument("--recompute-method", choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int)
    return p


def parse_args(argv: Optional[List[str]] = None, model: str = "gpt") -> Config:
    """Flags -> Config: defaults, then the family/size preset, then the flags given. `model` is the entry
    point's kind: "gpt" (pretrain_megatron_gpt.py) or "bert" (pretrain_megatron_bert.py, always --model-family bert)."""
    given = vars(build_parser(model).parse_args(argv))
    values = {}
    family = given.get("model_family")
    if model == "bert":
        if family not in (None, "bert"):
            raise ConfigError(f"--model-family {family}: pretrain_megatron_bert.py trains BERT; {family} trains with "
                              f"pretrain_megatron_gpt.py (pretrain_scripts/run_gpt.sh)")
        # As if given: a checkpoint of another family in --load is then refused, not silently trained as BERT.
        family = given["model_family"] = "bert"
        given.setdefault("tokenizer_type", "BertWordPieceLowerCase")  # Megatron-LM's pretrain_bert.py default
    else:
        if family == "bert":
            raise ConfigError("--model-family bert trains with pretrain_megatron_bert.py (pretrain_scripts/run_bert.sh), "
                              "not with this GPT entry point")
        bert_only = [flag for key, flag in BERT_FLAGS.items() if key in given]
        if bert_only:
            raise ConfigError(f"{', '.join(bert_only)} applies to BERT pretraining: use pretrain_megatron_bert.py "
                              f"(pretrain_scripts/run_bert.sh)")
        if family is None and "model_size" in given:
            family = "gpt"
    if family is not None:
        try:
            values.update(preset(family, given.get("model_size")))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    values.update(given)
    if given.get("load_hf"):  # the architecture of the Hugging Face model (and its dropout, unless given)
        model_source.merge(values, given, hf_source.from_hf(given["load_hf"]), f"--load-hf {given['load_hf']}/config.json",
                           apply_other=True)
    elif given.get("load"):  # resuming: the architecture stored with the checkpoint
        stored = model_source.from_checkpoint(given["load"])
        if stored:
            model_source.merge(values, given, stored, f"the checkpoint in --load {given['load']}")
    if values.get("mock_data") and "vocab_size" not in given and values.get("model_vocab_size"):
        values["vocab_size"] = values["model_vocab_size"]  # random tokens over the model's whole vocabulary
    return Config.from_flat(values)
