"""Known messages of megatron-core, torch and transformers that every worker would print: quieted in one place.

`quiet_known_noise()` runs first thing where a process starts (the `rapidformer` front end and its workers, the
pretraining entry points, megatron_patch.parallel.initialize), before torch or megatron-core print anything.
Each entry names the exact message, where it comes from and why it is harmless here, and how it is quieted:

    "ignore"      harmless in this engine everywhere: never shown
    "cpu"         harmless on a machine without a GPU (the CPU backend): never shown there, shown on a GPU
    "rank0"       useful once: shown by rank 0 only
    "cpu rank0"   both: never shown on the CPU, by rank 0 only on a GPU

Nothing else is filtered: an unknown warning still reaches the user from every rank.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import List, NamedTuple

import torch


class Known(NamedTuple):
    source: str     # a logger's name (logging) or a warning's module regex (warnings.warn)
    message: str    # regex matched at the start of the message
    scope: str      # "ignore", "cpu" or "rank0"
    why: str


WARNINGS: List[Known] = [  # warnings.warn(...): source = the module that warns (regex)
    Known(r"megatron\.core\.transformer\.transformer_config", r"full scope is deprecated", "ignore",
          "megatron-core's own default cuda_graph_scope warns at every TransformerConfig; no CUDA graphs are built"),
    Known(r"megatron\.core\.tensor_parallel\.layers", r"`sequence_parallel` is set to `True`, but tensor model "
          r"parallel size is 1\. Disabling sequence parallel", "ignore",
          "said by every expert linear at expert tensor-parallel size 1 under --sequence-parallel (megatron-core "
          "runs whole experts without it, as meant); validate() refuses --sequence-parallel without TP > 1"),
    Known(r"megatron\.core\.models\.mimo", r"MimoModelConfig is experimental", "ignore",
          "warned at import of megatron-core's multimodal package, which this engine does not use"),
    Known(r"megatron\.core\.tensor_parallel\.layers",
          r"When using sequence parallelism it is recommended to set the environment variable "
          r"CUDA_DEVICE_MAX_CONNECTIONS", "cpu rank0",
          "a speed hint for GPUs (the overlap of TP communication), the same on every rank; meaningless on the CPU"),
    Known(r"megatron\.core\.tensor_parallel\.layers",
          r"When using async grad allreduce it is recommended to set the environment variable "
          r"CUDA_DEVICE_MAX_CONNECTIONS", "cpu rank0",
          "the same speed hint, said by every TP rank's linears without sequence parallelism; meaningless on the CPU"),
    Known(r"megatron\.core\.datasets\.megatron_dataset", r"The pad token id in the tokenizer collides with another "
          r"special token id", "rank0",
          "said by every rank's dataset when the tokenizer pads with its end-of-text token (Qwen's and GPT-2's do): "
          "megatron-core then masks no pad token out of the loss, which is right for packed documents that fill every sample"),
    Known(r"megatron\.core(\.|$)", r"(Transformer Engine and Apex are|Apex is) not installed\. Falling back to",
          "ignore", "megatron-core announces its torch fallbacks at import; the run's own log names what it uses"),
    Known(r"megatron\.core\.hyper_comm_grid", r"absl\.logging is not installed", "ignore",
          "megatron-core falls back to Python's logging, which is what the engine uses"),
]

LOGS: List[Known] = [  # logger.warning(...): source = the logger's name
    Known("torch.utils.cpp_extension", r"No CUDA runtime is found", "cpu",
          "torch looks for CUDA when its C++-extension helper is imported; nothing here compiles CUDA code"),
    Known("megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED", "ignore",
          "the engine builds megatron-core's GPTModel on purpose (tested, pinned versions)"),
    Known("megatron.core.dist_checkpointing.strategies.torch", r"MCore's async save is deprecated", "ignore",
          "printed at every checkpoint save by the default strategy; the engine does not save asynchronously"),
    Known("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp", r"\[Rank \d+\] Megatron-FSDP is using "
          r"device cpu", "cpu", "on the CPU backend every tensor is on the CPU, which is the device meant"),
    Known("transformers.modeling_utils", r".*LOAD REPORT", "rank0",
          "from_pretrained's table of weights not found / newly initialized: the same on every worker"),
]


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _applies(known: Known) -> bool:
    """Whether this process hides the message."""
    scope = known.scope.split()
    return ("ignore" in scope or ("cpu" in scope and not torch.cuda.is_available())
            or ("rank0" in scope and _rank() != 0))


class _Drop(logging.Filter):
    """Drops the records of one logger whose message starts with one of `patterns`."""

    def __init__(self, patterns: List[str]) -> None:
        super().__init__()
        import re

        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(p.match(text) for p in self.patterns)


_DONE = False


def quiet_known_noise() -> None:
    """Install the filters above in this process (once). Ranks other than 0 also draw no progress bars of
    huggingface_hub/transformers (each worker would draw the same bar)."""
    global _DONE
    if _DONE:
        return
    _DONE = True
    for known in WARNINGS:
        if _applies(known):
            warnings.filterwarnings("ignore", message=known.message, module=known.source)
    by_logger = {}
    for known in LOGS:
        if _applies(known):
            by_logger.setdefault(known.source, []).append(known.message)
    for name, patterns in by_logger.items():
        logging.getLogger(name).addFilter(_Drop(patterns))
    if _rank() != 0:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when huggingface_hub is imported
