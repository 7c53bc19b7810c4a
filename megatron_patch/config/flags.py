"""The flag registry: every command-line flag of the project, declared once (a data table, longer than most files).

Three entry points read flags: `pretrain_megatron_gpt.py` ("gpt") and `pretrain_megatron_bert.py` ("bert"), with
the launchers in pretrain_scripts/ that pass their flags through to them, and the `rapidformer` command
("rapidformer"). A `Flag` names the entry points that take it; `flag_parser.build_parser(entry)` generates each
one's argparse parser from `FLAGS`, grouped by concern, and refuses a flag given to an entry point that does not
take it in words naming the one that does.

Defaults are declared once. A flag the engine takes gets its default from the engine's `Config`
(`getattr(Config(), dest)`); a flag only `rapidformer` takes holds its default here. Where `rapidformer` means
something else by a flag both take, the record's `front` says how, limited to: its default (None: "not given",
so the Hugging Face model's config or the front end's rules decide), its dest, its choices, its nargs, its names
and its help; each `Front` below says why.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Optional, Tuple, Union

from .config import Config
from .presets import FAMILIES, SIZES

GPT, BERT, RAPIDFORMER = "gpt", "bert", "rapidformer"
ENTRY_NAMES = (GPT, BERT, RAPIDFORMER)
ENGINE = frozenset({GPT, BERT})  # the engine's entry points: their defaults are Config's
ALL = frozenset(ENTRY_NAMES)
FRONT = frozenset({RAPIDFORMER})
BERT_ONLY = frozenset({BERT})
GPT_ONLY = frozenset({GPT})
GPT_LORA = frozenset({GPT, RAPIDFORMER})  # the engine's LoRA layers, and peft's on Hugging Face models

STORE_TRUE, STORE_FALSE = "store_true", "store_false"
_SAME = object()  # a Front field left as the engine's

TASKS = ("sequence_classification", "token_classification", "question_answering", "masked_lm",
         "casual_lm", "causal_lm", "seq2seq_lm", "pretraining")
FINETUNE_TASKS = TASKS[:-1]
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# (concern, title of its --help group), in --help order
CONCERNS: Tuple[Tuple[str, str], ...] = (
    ("launch", "launch"),
    ("model", "model"),
    ("moe", "mixture of experts (megatron-core MoELayer)"),
    ("bert", "BERT and masked LM"),
    ("data", "data"),
    ("training", "training: batches, iterations, learning rate, optimizer"),
    ("checkpoint", "checkpoints"),
    ("logging", "logging, evaluation and profiling"),
    ("parallel", "parallelism and sharding"),
    ("precision", "precision"),
    ("acceleration", "acceleration switches"),
)


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


@dataclass(frozen=True)
class Front:
    """How `rapidformer` takes a flag the engine takes too, where it means something else (see each use)."""
    default: Any = _SAME
    dest: Optional[str] = None
    choices: Optional[Tuple[str, ...]] = None
    nargs: Any = _SAME
    names: Optional[Tuple[str, ...]] = None  # a subset of the flag's names (an engine-only alias left out)
    help: Optional[str] = None


@dataclass(frozen=True)
class Flag:
    """One flag: its names (the first is canonical, the rest aliases), what it stores, the entry points that take
    it, its concern (the --help group) and its help. `kind` is the value's type (str, int, float or a parsing
    function) or STORE_TRUE / STORE_FALSE. `default` only for a flag the engine does not take."""
    names: Tuple[str, ...]
    kind: Any
    entries: FrozenSet[str]
    help: str
    concern: str = ""
    dest: str = ""
    choices: Optional[Tuple[str, ...]] = None
    nargs: Optional[str] = None
    metavar: Optional[str] = None
    default: Any = None
    front: Optional[Front] = None
    # an acceleration switch: rapidformer applies it once the user's model says what it is (a Megatron model: the
    # engine's Config; a Hugging Face one: accelerations.accelerate), so the front end's first Config leaves it out
    switch: bool = False

    def __post_init__(self):
        if not self.dest:
            object.__setattr__(self, "dest", self.names[0].lstrip("-").replace("-", "_"))
        if self.entries & ENGINE and self.default is not None:
            raise ValueError(f"{self.names[0]}: the engine takes it, so its default is Config's, not the registry's")
        if self.front is not None and RAPIDFORMER not in self.entries:
            raise ValueError(f"{self.names[0]}: a front-end override on a flag rapidformer does not take")

    @property
    def is_switch(self) -> bool:
        return self.kind in (STORE_TRUE, STORE_FALSE)

    def _front_or(self, entry: str, field: str, engine_value: Any, unset: Any = None) -> Any:
        """The front end's override of `field` for `entry` rapidformer (when the record has one), else the engine's."""
        if entry == RAPIDFORMER and self.front is not None:
            value = getattr(self.front, field)
            if value is not unset:
                return value
        return engine_value

    def names_for(self, entry: str) -> Tuple[str, ...]:
        return self._front_or(entry, "names", self.names) or self.names

    def dest_for(self, entry: str) -> str:
        return self._front_or(entry, "dest", self.dest) or self.dest

    def choices_for(self, entry: str) -> Optional[Tuple[str, ...]]:
        return self._front_or(entry, "choices", self.choices) or self.choices

    def nargs_for(self, entry: str) -> Optional[str]:
        return self._front_or(entry, "nargs", self.nargs, unset=_SAME)

    def help_for(self, entry: str) -> str:
        return self._front_or(entry, "help", self.help) or self.help

    def default_for(self, entry: str) -> Any:
        """The value a parser of `entry` gives the flag when it is not on the command line (the engine's parsers
        leave it out, argparse.SUPPRESS, and the preset or Config fills it in: this is then what Config says)."""
        if entry == RAPIDFORMER and self.front is not None and self.front.default is not _SAME:
            return self.front.default  # (None is an override here: "not given")
        if self.entries & ENGINE:
            return getattr(_engine_defaults(), self.dest)  # the one place the engine's defaults are declared
        if self.kind == STORE_TRUE:
            return False
        return self.default


@functools.lru_cache(maxsize=1)
def _engine_defaults() -> Config:
    return Config()  # read, never changed: the defaults shown in --help and rapidformer's for the flags both take


def _f(names: str, kind: Any, entries: FrozenSet[str], help: str, **kw) -> Flag:
    return Flag(names=tuple(names.split()), kind=kind, entries=entries, help=help, **kw)


def _concern(concern: str, *flags: Flag) -> Tuple[Flag, ...]:
    return tuple(dataclasses.replace(f, concern=concern) for f in flags)


# ---- the front end's overrides, each with its reason --------------------------------------------------------------
_SHAPE_HELP = ("Megatron models and --task pretraining: the model's shape; a Hugging Face model loaded as it is "
               "must agree with its config (a difference is refused)")
# Not given (None): a Hugging Face model keeps its config's shape; a Megatron model gets Config's default later
# (templates/engine_config.py); --task pretraining starts a model of the given shape.
SHAPE = Front(default=None, help=_SHAPE_HELP)
_HF_SETTING = ("; a Hugging Face model the black-box tasks load gets it in its config ({}); one a script builds must "
               "have it there")
# Not given (None): the front end's rules (templates/rules/) or the template choose per kind of run (--lr 5e-5,
# 8 samples per worker, 3 epochs unless --train-iters; a Megatron PreTrainer: Config's value, engine_config.py).
RULES_CHOOSE = Front(default=None)


# ---- the registry -------------------------------------------------------------------------------------------------
FLAGS: Tuple[Flag, ...] = (
    *_concern(
        "launch",
        _f("--task", str, FRONT, "what to train. Fine-tuning a model directory on local files: "
           "sequence_classification, token_classification, question_answering, masked_lm, causal_lm (the guide's "
           "casual_lm), seq2seq_lm. pretraining: trains the model directory (its weights, or new weights of the shape "
           "flags' shape) on a Megatron mmap corpus; needs --pretrained-model-name-or-path, --data-path PREFIX, "
           "--tokenizer-type, --vocab-file and --train-iters", choices=TASKS),
        _f("--user-script", str, FRONT, "a white-box script (a Finetuner or PreTrainer subclass) to run in every "
           "worker"),
        _f("--nproc-per-node", int, FRONT, "workers on this node (default: one per visible GPU, CUDA_VISIBLE_DEVICES; "
           "1 on a machine without GPU)"),
        _f("--max-restarts", int, FRONT, "pretraining: when a worker dies, torchrun stops the others and starts the job "
           "again, up to N times; each new attempt resumes from the newest complete checkpoint of --save by itself "
           "(torchrun's --max-restarts; default 0)"),
        _f("--validate-only", STORE_TRUE, ENGINE, "check the configuration for WORLD_SIZE processes (default 1) and "
           "the data, print the resolved settings and exit: 0 when sound, 2 with the reason otherwise (the launchers "
           "run this before torchrun)"),
    ),
    *_concern(
        "model",
        _f("--pretrained-model-name-or-path", str, FRONT, "a local Hugging Face model directory (or a name already in "
           "the local cache: nothing is downloaded)"),
        _f("--model-family", str, ENGINE, "architecture preset: gpt (GPT-2), llama, llama3 (3.1-3.3), "
           "qwen2 (and Qwen2.5), qwen3, mistral, mixtral, qwen2_moe, qwen3_moe, deepseek_v2; bert "
           "(pretrain_megatron_bert.py)", choices=tuple(FAMILIES)),
        _f("--model-size", str, ENGINE, "size preset of the family: "
           + "; ".join(f"{f}: {', '.join(s)}" for f, s in SIZES.items())),
        _f("--num-layers", int, ALL, "transformer layers", front=SHAPE),
        _f("--hidden-size", int, ALL, "width of the hidden states", front=SHAPE),
        _f("--num-attention-heads", int, ALL, "attention heads", front=SHAPE),
        _f("--num-query-groups", int, ENGINE, "key/value heads of grouped-query attention (default: one per head)"),
        _f("--ffn-hidden-size", int, ALL, "MLP width (default 4 x hidden size)",
           front=Front(help="MLP width (default 4 x hidden size); " + _SHAPE_HELP)),  # the shape note
        _f("--kv-channels", int, ENGINE, "attention head dimension (default: hidden size / attention heads)"),
        _f("--seq-length", int, ALL, "tokens per sample",
           # Not given (None): fine-tuning takes the model's maximum, at most 512 (cli/tasks).
           front=Front(default=None, help="fine-tuning: the longest tokenized input (default: the model's maximum, "
                                          "at most 512)")),
        _f("--max-position-embeddings", int, ALL, "positions the model embeds (default: --seq-length)",
           front=Front(help=_SHAPE_HELP)),  # the shape note; Config's default is None already
        _f("--rotary-base", int, ENGINE, "RoPE base (with --position-embedding-type rope)"),
        _f("--use-rope-scaling", STORE_TRUE, ENGINE, "Llama 3.1-3.3's RoPE scaling (Hugging Face rope_type llama3)"),
        _f("--rope-scaling-factor", float, ENGINE, "Llama 3.x RoPE scaling: the factor long wavelengths are "
           "divided by"),
        _f("--rope-scaling-low-freq-factor", float, ENGINE, "Llama 3.x RoPE scaling: low_freq_factor"),
        _f("--rope-scaling-high-freq-factor", float, ENGINE, "Llama 3.x RoPE scaling: high_freq_factor"),
        _f("--rope-scaling-original-max-position-embeddings", int, ENGINE, "Llama 3.x RoPE scaling: the context "
           "the model was first trained at (original_max_position_embeddings)"),
        _f("--qk-layernorm", STORE_TRUE, ENGINE, "normalise each query and key head before RoPE (Qwen3); with "
           "--multi-latent-attention: normalise the query and key/value latents (DeepSeek)"),
        _f("--multi-latent-attention", STORE_TRUE, ENGINE, "multi-latent attention (DeepSeek-V2/V3)"),
        _f("--q-lora-rank", int, ENGINE, "MLA: rank of the query latent (default: queries straight from the hidden "
           "state)"),
        _f("--kv-lora-rank", int, ENGINE, "MLA: rank of the shared key/value latent"),
        _f("--qk-head-dim", int, ENGINE, "MLA: each head's query/key channels without RoPE"),
        _f("--qk-pos-emb-head-dim", int, ENGINE, "MLA: the query/key channels RoPE rotates (shared key part)"),
        _f("--v-head-dim", int, ENGINE, "MLA: each head's value channels"),
        _f("--rope-type", str, ENGINE, "MLA's RoPE: rope, or yarn (YaRN's frequencies and softmax scaling)",
           choices=("rope", "yarn")),
        _f("--rotary-scaling-factor", float, ENGINE, "YaRN: the context extension factor"),
        _f("--original-max-position-embeddings", int, ENGINE, "YaRN: the context the model was first trained at"),
        _f("--beta-fast", float, ENGINE, "YaRN: beta_fast"),
        _f("--beta-slow", float, ENGINE, "YaRN: beta_slow"),
        _f("--mscale", float, ENGINE, "YaRN: mscale (the attention's scale on the rotated channels)"),
        _f("--mscale-all-dim", float, ENGINE, "YaRN: mscale_all_dim (the softmax scale)"),
        _f("--norm-epsilon", float, ENGINE, "epsilon of LayerNorm/RMSNorm"),
        # Not given (None, the three below): the Hugging Face model's config keeps its own dropout and init std
        _f("--hidden-dropout", float, ALL, "dropout of the hidden states",
           front=Front(default=None, help="Megatron models (default 0.1)" + _HF_SETTING.format(
               "hidden_dropout_prob, resid_pdrop/embd_pdrop, dropout ..."))),
        _f("--attention-dropout", float, ALL, "dropout of the attention probabilities",
           front=Front(default=None, help="Megatron models (default 0.1)" + _HF_SETTING.format(
               "attention_probs_dropout_prob, attn_pdrop, attention_dropout ..."))),
        _f("--init-method-std", float, ALL, "std of the normal weight init",
           front=Front(default=None, help="Megatron models: std of the normal weight init (0.02)" + _HF_SETTING.format(
               "initializer_range: the weights the directory does not hold, e.g. a new classification head"))),
        # Not given (None): refused for a Hugging Face model, whose config gives its vocabulary (config/flag_use.py)
        _f("--make-vocab-size-divisible-by", int, ALL, "pad the vocabulary to a multiple of this",
           front=Front(default=None, help="Megatron models: pad the vocabulary (128); refused for Hugging Face "
                                          "models (their config gives the vocabulary)")),
        _f("--vocab-size", int, ENGINE, "vocabulary of --tokenizer-type NullTokenizer and --mock-data"),
        _f("--position-embedding-type", str, ENGINE, "learned_absolute (GPT-2, BERT) or rope (the Llama family)",
           choices=("learned_absolute", "rope")),
        _f("--normalization", str, ENGINE, "LayerNorm or RMSNorm", choices=("LayerNorm", "RMSNorm")),
        _f("--attention-backend", str, ENGINE, "core attention: auto (Transformer Engine spec when installed, else "
           "sdpa), sdpa (torch scaled_dot_product_attention: flash/cuDNN kernels on GPU), local (megatron-core's "
           "unfused), te", choices=("auto", "sdpa", "local", "te")),
        _f("--init-layout-invariant", STORE_TRUE, ENGINE, "seed every weight from its global name so any TP/PP layout "
           "starts from identical weights (slower start-up; used by the parallel tests)"),
        _f("--swiglu", STORE_TRUE, ENGINE, "SwiGLU MLP (gated SiLU, the Llama family)"),
        _f("--openai-gelu", STORE_TRUE, ENGINE, "tanh-approximated GELU (GPT-2's gelu_new) instead of the exact one"),
        _f("--untie-embeddings-and-output-weights", STORE_TRUE, ENGINE, "an output layer of its own instead of the "
           "input embedding's"),
        _f("--disable-bias-linear", STORE_TRUE, ENGINE, "no biases in the linear layers"),
        _f("--add-qkv-bias", STORE_TRUE, ENGINE, "biases on the query/key/value projection (Qwen2)"),
        _f("--lora-rank", int, GPT_LORA, "LoRA: train adapters of this rank on --lora-target, every other weight "
           "frozen (0: off); Hugging Face models through peft"),
        _f("--lora-alpha", float, GPT_LORA, "LoRA: the adapters' output is scaled by alpha / rank"),
        _f("--lora-dropout", float, GPT_LORA, "LoRA: dropout on the adapters' input"),
        _f("--lora-target", str, GPT_LORA, "LoRA: the layers adapted, Megatron names (linear_qkv linear_proj "
           "linear_fc1 linear_fc2; the default, for a Hugging Face model every linear layer but the output head) "
           "or Hugging Face module names (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj ...)", nargs="+"),
    ),
    *_concern(
        "moe",
        _f("--num-experts", int, ALL, "experts per MoE layer of a Megatron model (default: a dense MLP)"),
        _f("--moe-router-topk", int, ENGINE, "experts each token is routed to"),
        _f("--moe-ffn-hidden-size", int, ENGINE, "MLP width of each expert (default --ffn-hidden-size)"),
        _f("--moe-layer-freq", moe_layer_freq, ENGINE, "experts every N layers, or a 0/1 per layer (1: experts) "
           "such as [0,1,1,1] or ([0]+[1]*3)*2"),
        _f("--moe-shared-expert-intermediate-size", int, ENGINE, "width of a shared expert that every token passes "
           "(Qwen2-MoE)"),
        _f("--moe-aux-loss-coeff", float, ENGINE, "weight of the load-balancing loss"),
        _f("--moe-z-loss-coeff", float, ENGINE, "weight of the router's z-loss"),
        _f("--moe-expert-capacity-factor", float, ENGINE, "an expert's capacity as a multiple of its even share of "
           "tokens; tokens beyond it are dropped (default: no limit)"),
        _f("--expert-model-parallel-size", int, ENGINE, "ranks the experts are spread over"),
        _f("--expert-tensor-parallel-size", int, ENGINE, "tensor-parallel size inside each expert (default "
           "--tensor-model-parallel-size)"),
        _f("--moe-router-load-balancing-type", str, ENGINE, "how the router balances the experts' load",
           choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")),
        _f("--moe-token-dispatcher-type", str, ENGINE, "how tokens reach their experts' ranks",
           choices=("alltoall", "allgather")),
        _f("--moe-token-drop-policy", str, ENGINE, "which tokens an expert over its capacity drops",
           choices=("probs", "position")),
        _f("--moe-router-pre-softmax", STORE_TRUE, ENGINE, "the router's softmax over all experts, before the top-k"),
        _f("--moe-router-topk-scaling-factor", float, ENGINE, "multiply the routed experts' weights by this "
           "(DeepSeek's routed_scaling_factor)"),
        _f("--moe-pad-expert-input-to-capacity", STORE_TRUE, ENGINE, "pad each expert's tokens to its capacity"),
        _f("--moe-per-layer-logging", STORE_TRUE, ENGINE, "log the routing losses of every MoE layer"),
        _f("--moe-shared-expert-gate", STORE_TRUE, ENGINE, "scale the shared expert's output by a sigmoid gate "
           "(Qwen2-MoE)"),
        _f("--moe-grouped-gemm", STORE_TRUE, ENGINE, "run each MoE layer's experts as two grouped GEMMs "
           "(torch._grouped_mm) instead of a GEMM pair per expert; same parameters and checkpoints (expert tensor "
           "parallel size 1, not with ZeRO-2)"),
    ),
    *_concern(
        "bert",
        _f("--bert-no-binary-head", STORE_FALSE, BERT_ONLY, "masked LM only: no pooler, next-sentence head or loss "
           "(the data then needs no sentence pairs)", dest="bert_binary_head"),
        _f("--mask-prob", float, BERT_ONLY | FRONT, "share of tokens masked for the masked-LM objective"),
        _f("--short-seq-prob", float, BERT_ONLY | FRONT, "share of BERT samples made shorter than --seq-length"),
    ),
    *_concern(
        "data",
        _f("--data-path", str, ALL, "prefix, or 'weight prefix weight prefix ...' to blend", nargs="+",
           # One value (None: not given): a directory of fine-tuning files or one mmap prefix
           front=Front(default=None, nargs=None, help="fine-tuning: a local directory of train/validation/test files "
                       "(jsonl, json, csv, parquet), a save_to_disk directory, or a dataset name in the local Hugging "
                       "Face cache; pretraining: the prefix of a Megatron mmap corpus (PREFIX.bin/.idx)")),
        _f("--data-name --dataset-name", str, FRONT, "the dataset's configuration (e.g. mrpc): a subdirectory of "
           "--data-path (refused when there is none)"),
        _f("--data-dir", str, FRONT, "where the fine-tuning files are, as datasets' data_dir"),
        _f("--text-columns", str, FRONT, "the input text column(s); found by their usual names otherwise", nargs="+"),
        _f("--label-column", str, FRONT, "the label column; found by its usual name otherwise"),
        _f("--mock-data", STORE_TRUE, ENGINE, "random tokens (tests and benchmarks)"),
        _f("--split", str, ALL, "train,validation,test weights of a pretraining corpus"),
        _f("--tokenizer-type", str, ALL, "the pretraining corpus's tokenizer, by megatron-core's name "
           "(GPT2BPETokenizer, BertWordPieceLowerCase, SentencePieceTokenizer, HuggingFaceTokenizer, NullTokenizer, "
           "...)",
           # The Hugging Face templates build these three tokenizers only (templates/pretraining_data.py)
           front=Front(choices=("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer"))),
        # --vocab: Megatron-LM's short name, which the guide's rapidformer never had
        _f("--vocab-file --vocab", str, ALL, "the tokenizer's vocabulary file", front=Front(names=("--vocab-file",))),
        _f("--merge-file", str, ALL, "the BPE merges of GPT2BPETokenizer"),
        _f("--tokenizer-model", str, ENGINE, "the SentencePiece or Hugging Face tokenizer model"),
        _f("--data-impl", str, ALL, "how a pretraining corpus (.bin/.idx) is read",
           choices=("mmap", "cached", "lazy", "infer")),
        _f("--data-iterator", str, ALL, "batch shapes of pretraining: fixed-shape (packed --seq-length samples) or "
           "dynamic-shape (the PreTrainer's document samples, each batch padded to its longest; fine-tuning always "
           "pads so)", choices=("fixed-shape", "dynamic-shape"), front=RULES_CHOOSE),
        _f("--data-cache-path", str, ALL, "where megatron-core's dataset index caches go (default: next to the data)"),
        _f("--num-workers", int, ALL, "DataLoader worker processes"),
        _f("--pad-to-multiple-of", int, FRONT, "pad each fine-tuning batch to a multiple of N tokens instead of "
           "exactly its longest sample (fewer distinct shapes; default 64 with --torch-compile-mode "
           "reduce-overhead/max-autotune)"),
        _f("--mmap-warmup", STORE_TRUE, FRONT, "read the whole mmap corpus once at start"),
        _f("--eod-mask-loss", STORE_TRUE, ALL, "pretraining: no loss on end-of-document tokens"),
        _f("--sft", STORE_TRUE, GPT_ONLY, "supervised fine-tuning on the chat data of tools/preprocess_data.py --sft "
           "(--data-path PREFIX_text_document): loss on the assistant tokens only, per token over the global batch"),
        _f("--no-pack-sequences", STORE_FALSE, GPT_ONLY, "--sft: one conversation per sample, padded to --seq-length "
           "(default: several conversations packed per sample, each attending and counting positions on its own)",
           dest="pack_sequences"),
        _f("--calculate-per-token-loss", STORE_TRUE, GPT_ONLY, "average the loss over the tokens of the whole global "
           "batch instead of per micro batch (on with --sft)"),
        _f("--reset-position-ids", STORE_TRUE, FRONT, "pretraining: positions restart after each end-of-document "
           "token"),
        _f("--reset-attention-mask", STORE_TRUE, FRONT, "pretraining: attend within documents only (not supported: "
           "refused)"),
    ),
    *_concern(
        "training",
        _f("--micro-batch-size", int, ALL, "batch size of each worker", front=RULES_CHOOSE),
        _f("--global-batch-size", int, ALL, "batch size of all workers together (iteration-based runs accumulate "
           "gradients to reach it)"),
        _f("--train-iters", int, ALL, "optimizer steps (an iteration-based run; pretraining needs it)",
           front=RULES_CHOOSE),
        _f("--epochs", int, FRONT, "passes over the training set (epoch-based fine-tuning)"),
        _f("--lr", float, ALL, "peak learning rate", front=RULES_CHOOSE),
        _f("--min-lr", float, ALL, "learning rate at the end of the decay"),
        _f("--lr-decay-style", str, ALL, "the learning rate's decay after warmup",
           choices=("constant", "linear", "cosine")),
        _f("--lr-decay-iters", int, ALL, "iterations of the decay (default: all of training)"),
        _f("--lr-warmup-fraction", float, ALL, "warmup iterations as a fraction of the decay's"),
        _f("--lr-warmup-iters", int, ALL, "iterations of linear warmup", front=RULES_CHOOSE),
        _f("--weight-decay", float, ALL, "weight decay of the optimizer"),
        _f("--clip-grad", float, ALL, "clip the gradients' global norm to this"),
        _f("--adam-beta1", float, ALL, "Adam's beta1"),
        _f("--adam-beta2", float, ALL, "Adam's beta2"),
        _f("--adam-eps", float, ALL, "Adam's epsilon"),
        _f("--optimizers", str, ALL, "Adam or LAMB: apex's fused kernels when apex is installed, else torch's "
           "fused AdamW / our LAMB", choices=("apex_adam", "apex_lamb")),
        _f("--seed", int, ALL, "random seed"),
        _f("--no-exit-on-nan", STORE_FALSE, ENGINE, "keep going after a NaN/Inf loss", dest="exit_on_nan"),
        _f("--exit-interval", int, ENGINE, "stop (after saving) when the iteration is a multiple of this"),
        _f("--skip-train", STORE_TRUE, ENGINE, "only evaluate (validation and test sets), e.g. after --load"),
        _f("--distributed-timeout-minutes", float, ENGINE, "timeout of every collective (init_process_group's: gloo "
           "raises, NCCL's watchdog aborts), Megatron-LM's flag"),
        _f("--heartbeat-timeout-seconds", float, ENGINE, "a worker whose heartbeat (a thread, every 2 s, through the "
           "rendezvous store) stops for this long (stopped, frozen, machine gone) ends the job, named in one line; "
           "shorter than --distributed-timeout-minutes"),
        _f("--step-timeout-minutes", float, ENGINE, "end the job when a rank spends longer than this in one step, "
           "checkpoint save or evaluation, naming every rank's position (default: off)"),
    ),
    *_concern(
        "checkpoint",
        _f("--save", str, ALL, "where the checkpoints are written",
           front=Front(help="where the trained model is saved (save_pretrained; fine-tuning: with its tokenizer; "
                            "pretraining: also the checkpoints --load resumes from)")),
        _f("--load", str, ALL, "resume from the newest complete checkpoint in this directory",
           front=Front(help="the weights a template loads (Hugging Face templates: defaults to "
                            "--pretrained-model-name-or-path)")),
        _f("--load-hf", str, ENGINE, "start from a Hugging Face model directory (config.json + safetensors; GPT-2, "
           "Llama, Qwen2, Mistral, Mixtral, Qwen2-MoE): architecture from its config, weights loaded into any "
           "TP/PP/EP layout", metavar="DIR"),
        _f("--save-interval", int, ALL, "pretraining: write a checkpoint to --save every N iterations (and at the "
           "end); --load DIR resumes from it"),
        _f("--no-load-optim", STORE_TRUE, ENGINE, "with --load, take only the weights (fine-tuning)"),
        _f("--override-opt-param-scheduler", STORE_TRUE, ALL, "pretraining, resuming with --load: continue from the "
           "checkpoint's step with this run's learning-rate schedule flags where they differ from the checkpoint's "
           "(--lr, --min-lr, --lr-decay-*, warmup, --weight-decay, --train-iters: refused otherwise)"),
        _f("--use-checkpoint-opt-param-scheduler", STORE_TRUE, ALL, "pretraining, resuming with --load: keep the "
           "checkpoint's learning-rate schedule, whatever this run's schedule flags say"),
        _f("--keep-last-n", int, ENGINE, "after each save, delete all but the newest N complete checkpoints"),
        _f("--dist-ckpt-optim-fully-reshardable", STORE_TRUE, ENGINE, "ZeRO-1: save the distributed optimizer's state "
           "per parameter (Megatron-LM's flag), so a resume at another TP/PP/DP size keeps it (dense models); each "
           "model-parallel group's data-parallel rank 0 gathers its state at a save (more memory and time there)"),
        _f("--async-save", STORE_TRUE, ENGINE, "write checkpoints in the background (Megatron-LM's flag): a save stalls "
           "training only to plan it and copy this rank's state to host memory; the checkpoint is published (manifest, "
           "tracker) once every rank has written it, so a crash meanwhile leaves the previous one the newest (ZeRO-0/1)"),
    ),
    *_concern(
        "logging",
        _f("--log-interval", int, ALL, "log a training line every N steps"),
        _f("--eval-interval", int, ALL, "pretraining: validate every N iterations; fine-tuning (when given): also "
           "evaluate every N optimizer steps, besides after every epoch"),
        _f("--eval-iters", int, ALL, "pretraining: validation batches per evaluation (fine-tuning evaluates the "
           "whole validation split)"),
        _f("--eval-at-start", STORE_TRUE, FRONT, "also evaluate before training (reported as epoch 0)"),
        _f("--metrics-file", str, ALL, "append one JSON line of metrics per iteration to this file (rank 0)",
           front=Front(help="append one JSON line per evaluation (default: SAVE/metrics.jsonl)")),
        _f("--tensorboard-dir", str, ALL, "TensorBoard logs",
           front=Front(help="TensorBoard logs (default: SAVE/tensorboard)")),  # the front end's rules' default
        _f("--profile", STORE_TRUE, ENGINE, "torch.profiler over iterations (--profile-step-start, "
           "--profile-step-end]: Chrome trace and a GPU-time breakdown (matmul, attention, loss, optimizer, idle) in "
           "--profile-dir"),
        _f("--profile-step-start", int, ENGINE, "the profiled iterations start after this one"),
        _f("--profile-step-end", int, ENGINE, "the last profiled iteration"),
        _f("--profile-dir", str, ENGINE, "where --profile writes"),
    ),
    *_concern(
        "parallel",
        _f("--tensor-model-parallel-size", int, ALL, "tensor-parallel size (Megatron models only)"),
        _f("--pipeline-model-parallel-size", int, ALL, "pipeline-parallel size (Megatron models only)"),
        _f("--num-layers-per-virtual-pipeline-stage", int, ALL, "Megatron models: the interleaved pipeline schedule, "
           "this many layers per virtual stage"),
        _f("--sequence-parallel", STORE_TRUE, ENGINE, "with tensor parallelism: split the activations outside "
           "attention and MLP along the sequence"),
        _f("--zero-1-memory-optimization", STORE_TRUE, ALL, "ZeRO-1: optimizer state sharded across workers",
           switch=True),
        _f("--zero-2-memory-optimization", STORE_TRUE, ALL, "ZeRO-2: optimizer state and gradients sharded",
           switch=True),
        _f("--zero-3-memory-optimization", STORE_TRUE, ALL, "ZeRO-3: optimizer state, gradients and parameters "
           "sharded (Hugging Face models)", switch=True),
        _f("--oss-memory-optimization", STORE_TRUE, FRONT, "OSS: optimizer state sharded"),
        _f("--oss-sdp-memory-optimization", STORE_TRUE, FRONT, "SDP: optimizer state and gradients sharded"),
        _f("--fsdp-memory-optimization", STORE_TRUE, FRONT, "FSDP: optimizer state, gradients and parameters sharded"),
        _f("--cpu-offload", STORE_TRUE, ALL, "optimizer state and step on the CPU", switch=True),
    ),
    *_concern(
        "precision",
        _f("--mixed-precision", STORE_TRUE, ALL, "fp16 with dynamic loss scaling", switch=True),
        _f("--bf16", STORE_TRUE, ALL, "bf16 (no loss scaling needed)", switch=True),
        _f("--fp16", STORE_TRUE, ENGINE, "fp16 with loss scaling (as --mixed-precision)", switch=True),
        _f("--grad-reduce-in-bf16", STORE_TRUE, ENGINE, "with --bf16: accumulate and reduce gradients in bf16 "
           "instead of fp32 (Megatron-LM's flag): half the gradient buffer and its traffic, coarser accumulation over "
           "micro batches"),
        _f("--fp8-format", str, ENGINE, "FP8 GEMMs in the transformer layers' linears (Megatron-LM's flag): hybrid "
           "(e4m3 forward, e5m2 gradients) or e4m3; Transformer Engine's when installed, torchao's otherwise (with "
           "--fp8-recipe tensorwise: hybrid, rowwise: e4m3); weights and checkpoints keep their precision",
           choices=("hybrid", "e4m3")),
        _f("--fp8-recipe", str, ENGINE, "with --fp8-format: scaling recipe; torchao: tensorwise (one scale per tensor, "
           "amax reduced over tensor parallelism) or rowwise (per-row power-of-two scales); Transformer Engine also "
           "delayed, mxfp8, blockwise", choices=("tensorwise", "rowwise", "delayed", "mxfp8", "blockwise")),
        _f("--fp8-layers", str, ENGINE, "with torchao's FP8: which linears; auto keeps those torchao measured as "
           "slower in FP8 (small GEMMs) in high precision, all converts every linear whose dimensions are multiples "
           "of 16", choices=("auto", "all")),
        _f("--loss-scale", float, ENGINE, "static loss scale for fp16 (default: dynamic)"),
        _f("--initial-loss-scale", float, ENGINE, "the dynamic loss scale's first value"),
        _f("--min-loss-scale", float, ENGINE, "dynamic scaling never goes below this"),
        _f("--loss-scale-window", float, ENGINE, "clean steps before the dynamic loss scale doubles"),
        _f("--hysteresis", int, ENGINE, "overflowing steps tolerated before the dynamic loss scale halves"),
    ),
    *_concern(
        "acceleration",
        _f("--compile --torch-compile", STORE_TRUE, ALL, "compile the model with torch.compile (a Megatron model: each "
           "transformer layer, GPU; the attention only in MoE layers)",
           front=Front(dest="torch_compile"), switch=True),  # the front end's name, read by its templates and samples
        _f("--compile-mode --torch-compile-mode", str, ALL, "torch.compile's mode with --compile; reduce-overhead "
           "replays each compiled layer as a CUDA graph (less host overhead for small models, more memory)",
           choices=tuple(m for m in COMPILE_MODES if m != "max-autotune"),
           # the front end's name; None: not given (given, it turns on --torch-compile); max-autotune as well
           # (whole-model CUDA graphs of padded Hugging Face batches, accelerations/compile.py)
           front=Front(dest="torch_compile_mode", default=None, choices=COMPILE_MODES,
                       help="torch.compile's mode (implies --torch-compile); reduce-overhead and max-autotune replay "
                            "each step's kernels as CUDA graphs (GPU only), for batches padded to "
                            "--pad-to-multiple-of"), switch=True),
        _f("--checkpoint-activations", STORE_TRUE, ALL, "recompute activations in the backward pass", switch=True),
        _f("--recompute-granularity", str, ENGINE, "with --checkpoint-activations: whole layers (full) or the "
           "attention core (selective)", choices=("full", "selective")),
        _f("--recompute-method", str, ENGINE, "full recompute: of every layer in chunks (uniform) or of the first "
           "layers of each stage (block)", choices=("uniform", "block")),
        _f("--recompute-num-layers", int, ENGINE, "layers per recomputed chunk (uniform) or per stage (block)"),
        _f("--gradient-accumulation-fusion", STORE_TRUE, ENGINE, "linear layers accumulate their weight gradients "
           "straight into the gradient buffer (one GEMM per weight and micro batch, no separate add; Megatron-LM's "
           "default with apex)"),
        _f("--exp-avg-dtype", str, ENGINE, "dtype of Adam's first moment (Megatron-LM's flag): bf16 halves it (with "
           "--optimizer-step-fusion, whose kernel computes in fp32 and stores bf16; megatron-core's own precision-aware "
           "optimizer needs Transformer Engine)", choices=("fp32", "bf16")),
        _f("--exp-avg-sq-dtype", str, ENGINE, "dtype of Adam's second moment, as --exp-avg-dtype",
           choices=("fp32", "bf16")),
        _f("--optimizer-step-fusion", STORE_TRUE, ENGINE, "with --bf16: the Adam step in one Triton kernel (one launch "
           "per param group) that reads the gradient buffer, clips, updates the fp32 weights and moments and writes "
           "the bf16 weights (no fp32 gradient copies, one pass instead of four; GPU, or TRITON_INTERPRET=1 on the "
           "CPU)"),
        _f("--cross-entropy-loss-fusion", STORE_TRUE, ENGINE, "fused loss (Megatron-LM's flag; GPT/Llama families): "
           "see --cross-entropy-fusion-impl"),
        _f("--cross-entropy-fusion-impl", str, ENGINE, "with --cross-entropy-loss-fusion: native (megatron-core's "
           "fused softmax cross entropy of the logits), te (Transformer Engine's), linear (output layer and cross "
           "entropy fused, a chunk of tokens at a time: the full logits never exist; less memory), triton (Triton "
           "kernels over the logits: one read forward, the gradient written over the logits; needs a GPU, or "
           "TRITON_INTERPRET=1 on the CPU)", choices=("native", "te", "linear", "triton")),
        _f("--onnx-runtime-training", STORE_TRUE, FRONT, "train through ONNX Runtime's ORTModule (optional extra)"),
        _f("--padding-free", STORE_TRUE, FRONT, "fine-tuning a BERT-family encoder (--task sequence_classification or "
           "token_classification, or a Finetuner script with such a model): each training micro batch's samples are "
           "concatenated into one row of tokens, padded only to a multiple of --pad-to-multiple-of (default 64; 256 "
           "with --torch-compile-mode reduce-overhead: one CUDA graph per token budget), positions restart per sample "
           "and attention stays within each sample (flash kernels on variable-length sequences); the same samples, "
           "order and loss as the padded run; evaluation stays padded"),
    ),
)

BY_NAME: Dict[str, Flag] = {name: f for f in FLAGS for name in f.names}


def for_entry(entry: str) -> Tuple[Flag, ...]:
    """The flags `entry` ("gpt", "bert" or "rapidformer") takes, in registry order."""
    if entry not in ENTRY_NAMES:
        raise ValueError(f"unknown entry point {entry!r}: one of {', '.join(ENTRY_NAMES)}")
    return tuple(f for f in FLAGS if entry in f.entries)


def switches() -> FrozenSet[str]:
    """The Config fields of the acceleration switches (`Flag.switch`)."""
    return frozenset(f.dest for f in FLAGS if f.switch)


def front_to_engine() -> Dict[str, str]:
    """rapidformer dest -> Config field, for the flags rapidformer and the engine both take."""
    return {f.dest_for(RAPIDFORMER): f.dest for f in FLAGS if RAPIDFORMER in f.entries and f.entries & ENGINE}


def declarations() -> Dict[str, int]:
    """How many flags the registry declares: records (one per flag) and option strings (names and aliases)."""
    return {"flags": len(FLAGS), "option_strings": sum(len(f.names) for f in FLAGS)}
