"""Pretraining data for the white-box templates: BERT masked-LM + next-sentence samples in the form a
Hugging Face `BertForPreTraining` takes, and the tokenizer the `rapidformer` flags name.

`build_train_valid_test_datasets_for_huggingface` keeps Megatron-LM's signature; the samples are drawn by
megatron-core's BERTMaskedWordPieceDataset (`megatron_patch.data.datasets.build_bert_datasets`) and each one
is re-expressed with Hugging Face's conventions:

===================  ==========================  ==================================================
key                  megatron-core sample        Hugging Face sample (int64 tensor)
===================  ==========================  ==================================================
input_ids            text                        [seq]: the tokens, [MASK]/random at masked positions
attention_mask       padding_mask (1 = token,    [seq]: 1 on real tokens, 0 on padding
                     pad id on padding)
token_type_ids       types (0 = A, 1 = B, pad    [seq]: 0 on [CLS] A [SEP] and padding, 1 on B [SEP]
                     id on padding)
labels               labels (-1 where not        [seq]: the original token where loss_mask is 1,
                     masked) + loss_mask         -100 elsewhere (CrossEntropyLoss's ignore_index)
next_sentence_label  is_random (1 = A and B      []: the same value: HF's 1 means "B is not A's
                     swapped, 0 = in order)      continuation", 0 means it is
===================  ==========================  ==================================================

With `binary_head=False` the samples have one segment and no next-sentence task, so `next_sentence_label`
is left out: the batch then fits `BertForMaskedLM`.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

__all__ = ["BertPretrainingSamples", "build_train_valid_test_datasets_for_huggingface", "get_tokenizer"]

# Hugging Face's losses skip label -100 (torch.nn.CrossEntropyLoss's default ignore_index).
IGNORE_INDEX = -100

# The flags `get_tokenizer` reads, in the order their absence is reported.
_TOKENIZER_FLAGS = ("tokenizer_type", "vocab_file", "merge_file")
_NEEDS_VOCAB = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer")

# Tokenizers built so far, keyed by the flags they were built from: built once per run, and a test (or a
# run) that sets other flags with set_args() does not get a stale one.
_TOKENIZERS: Dict[Tuple[Any, ...], Any] = {}


def get_tokenizer():
    """The tokenizer named by the `rapidformer` flags `--tokenizer-type`, `--vocab-file` and `--merge-file`
    (GPT2BPETokenizer), built once by `megatron_patch.data.tokenizers.build_tokenizer` and then reused.

    It has `vocab_size` and `eod` (GPT samples), and for the BERT WordPiece types also the `cls`, `sep`,
    `mask`, `pad` and `inv_vocab` that megatron-core's BERT dataset reads. Missing flags raise a ValueError
    naming them."""
    from megatron_patch.data.tokenizers import build_tokenizer

    from .globals import get_args

    args = get_args()
    absent = [f for f in _TOKENIZER_FLAGS if not hasattr(args, f)]
    if absent:
        flags = ", ".join("--" + f.replace("_", "-") for f in absent)
        raise ValueError(f"get_tokenizer(): the run's arguments have no {flags} flag at all; they must come from "
                         "the rapidformer parser (megatron_patch.config.rapidformer_flags), or pass tokenizer= explicitly")
    tokenizer_type, vocab_file, merge_file = (getattr(args, f) for f in _TOKENIZER_FLAGS)
    if not tokenizer_type:
        raise ValueError("get_tokenizer() needs --tokenizer-type (BertWordPieceLowerCase, BertWordPieceCase or "
                         "GPT2BPETokenizer) and --vocab-file PATH (plus --merge-file PATH for GPT2BPETokenizer)")
    if tokenizer_type in _NEEDS_VOCAB and not vocab_file:
        merges = " and --merge-file PATH (merges.txt)" if tokenizer_type == "GPT2BPETokenizer" else ""
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs --vocab-file PATH{merges}")
    model, size = getattr(args, "tokenizer_model", None), getattr(args, "vocab_size", None)
    key = (tokenizer_type, vocab_file, merge_file, model, size)
    if key not in _TOKENIZERS:
        # build_tokenizer's own errors name --merge-file and any unreadable file.
        _TOKENIZERS[key] = build_tokenizer(tokenizer_type, vocab_file=vocab_file, merge_file=merge_file,
                                           tokenizer_model=model, vocab_size=size)
    return _TOKENIZERS[key]


class BertPretrainingSamples(torch.utils.data.Dataset):
    """A megatron-core BERT dataset whose samples are `BertForPreTraining` keyword arguments (see the module
    docstring): `input_ids`, `attention_mask`, `token_type_ids`, `labels` of shape [seq] and, with the
    next-sentence task, `next_sentence_label` of shape [] — all int64 tensors, so default collate stacks them."""

    def __init__(self, dataset, tokenizer, binary_head: bool = True) -> None:
        self.dataset = dataset
        self.binary_head = binary_head
        # megatron-core marks padding in padding_mask with the pad id; only when that id is 1 does the mask
        # not tell padding from tokens, and then a sample's tokens are those up to its last [SEP].
        try:
            self._pad_is_one = tokenizer.pad == 1
        except (AttributeError, NotImplementedError):
            self._pad_is_one = False
        self._sep = tokenizer.sep

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        sample = self.dataset[idx]
        text = np.asarray(sample["text"], dtype=np.int64)
        if self._pad_is_one:
            last_sep = int(np.nonzero(text == self._sep)[0].max())
            real = np.arange(text.shape[0]) <= last_sep
        else:
            real = np.asarray(sample["padding_mask"]) == 1
        # labels alone cannot be trusted: megatron-core writes 0 over the -1s when it falls back to pad id -1.
        masked = np.asarray(sample["loss_mask"]) == 1
        out = {
            "input_ids": torch.from_numpy(text),
            "attention_mask": torch.from_numpy(real.astype(np.int64)),
            # types are padded with the pad id, which may not be a valid segment id: padding is segment 0.
            "token_type_ids": torch.from_numpy(np.where(real, sample["types"], 0).astype(np.int64)),
            "labels": torch.from_numpy(np.where(masked, sample["labels"], IGNORE_INDEX).astype(np.int64)),
        }
        if self.binary_head:
            # megatron-core's is_random=1 swaps segments A and B, so B does not follow A: HF's label 1.
            out["next_sentence_label"] = torch.tensor(int(sample["is_random"]), dtype=torch.int64)
        return out


def _as_list(data_prefix: Union[str, Sequence[str]]) -> List[str]:
    if not isinstance(data_prefix, str):
        return [str(p) for p in data_prefix]
    # One prefix (which may contain spaces), or Megatron's blend written as one string: "0.3 a 0.7 b".
    if os.path.isfile(data_prefix + ".idx"):
        return [data_prefix]
    return data_prefix.split()


def _warm_up(prefixes: Sequence[str]) -> None:
    """Read each .bin once: our reader needs no warmup, this only fills the page cache (--mmap-warmup)."""
    for prefix in prefixes:
        with open(prefix + ".bin", "rb") as f:
            while f.read(1 << 24):
                pass


def _data_cache_path() -> Optional[str]:
    # Only flags already set are consulted: get_args() would otherwise parse this process's own argv.
    from . import globals as run_globals

    return getattr(run_globals._ARGS, "data_cache_path", None)


def build_train_valid_test_datasets_for_huggingface(
    data_prefix: Union[str, Sequence[str]],
    data_impl: str,
    splits_string: str,
    train_valid_test_num_samples: Sequence[int],
    max_seq_length: int,
    masked_lm_prob: float,
    short_seq_prob: float,
    seed: int,
    skip_warmup: bool,
    binary_head: bool = True,
    tokenizer=None,
) -> Tuple[Optional[BertPretrainingSamples], Optional[BertPretrainingSamples], Optional[BertPretrainingSamples]]:
    """(train, valid, test) BERT pretraining datasets for a Hugging Face `BertForPreTraining`.

    `data_prefix`: a corpus made by `tools/preprocess_data.py --split-sentences` (the prefix ending in
    `_text_sentence`), or Megatron's blend `[w1, p1, w2, p2, ...]` (a list, or one space-separated string).
    `splits_string` is Megatron's `--split` ("969,30,1"); a split of weight 0 ("980,20" has no test split),
    or one asked for 0 samples, is None. Samples are BertPretrainingSamples items: 15% (`masked_lm_prob`)
    whole-word masking, 80/10/10, `max_seq_length` tokens with padding, next-sentence pairs when
    `binary_head`. `skip_warmup=False` reads each .bin once first (our reader needs no warmup; this only
    warms the page cache). The tokenizer is the flags' (`get_tokenizer()`) unless given."""
    from megatron_patch.data.datasets import build_bert_datasets, parse_data_path

    prefixes = _as_list(data_prefix)
    if not skip_warmup:
        _warm_up(parse_data_path(prefixes)[0])
    tokenizer = tokenizer if tokenizer is not None else get_tokenizer()
    wanted = [int(n) for n in train_valid_test_num_samples]
    if len(wanted) != 3 or min(wanted) < 0:
        raise ValueError(f"train_valid_test_num_samples {list(train_valid_test_num_samples)}: give three counts >= 0")
    # A split of weight 0 comes back None; one asked for 0 samples comes back empty (megatron-core stops
    # its sample index at the count asked for): both are None here, so a loop over a split never sees 0 steps.
    splits = build_bert_datasets(prefixes, tokenizer, max_seq_length, tuple(wanted), split=splits_string,
                                 seed=seed, data_impl=data_impl, cache_dir=_data_cache_path(),
                                 masking_probability=masked_lm_prob, short_seq_prob=short_seq_prob,
                                 binary_head=binary_head)
    return tuple(
        BertPretrainingSamples(ds, tokenizer, binary_head) if ds is not None and len(ds) > 0 else None
        for ds in splits
    )
