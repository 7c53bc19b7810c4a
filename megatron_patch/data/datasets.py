"""Training datasets on megatron-core: GPT samples (GPTDataset) and BERT masked-LM + next-sentence
samples (BERTMaskedWordPieceDataset), built by BlendedMegatronDatasetBuilder with blending
(`--data-path 0.3 a 0.7 b`), `--split 969,30,1` and index caches on disk.

megatron-core always opens data through its own reader; the subclasses here open it through ours,
so `--data-impl mmap|cached|lazy|infer` is honoured and a corrupt file is refused with a clear message.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Callable, List, Optional, Sequence, Tuple

from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from .indexed_dataset import DATA_IMPLS, IndexedDataset, idx_path

Blend = Tuple[List[str], Optional[List[float]]]


def parse_data_path(data_path: Sequence[str]) -> Blend:
    """`--data-path a` / `a b` (weights from sizes) / `0.3 a 0.7 b` -> (prefixes, weights or None)."""
    items = list(data_path)
    if not items:
        raise ValueError("--data-path is empty: give a prefix (made by tools/preprocess_data.py) or 'w1 p1 w2 p2 ...'")

    def is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if len(items) == 1 or not is_number(items[0]):
        prefixes, weights = items, None
    else:
        if len(items) % 2:
            raise ValueError(f"--data-path {' '.join(items)}: weighted blends come in pairs 'weight prefix ...'")
        weights = [float(w) for w in items[0::2]]
        prefixes = items[1::2]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"--data-path weights {weights} must be non-negative and not all zero")
    for p in prefixes:
        if not os.path.isfile(idx_path(p)):
            raise FileNotFoundError(
                f"--data-path {p}: {idx_path(p)} not found; pass the prefix without .bin/.idx, e.g. my_corpus_text_document"
            )
    return prefixes, weights


def _our_reader(dataset_path: str, config) -> IndexedDataset:
    ds = IndexedDataset(dataset_path, impl=getattr(config, "data_impl", "mmap"))
    ds.path_prefix = dataset_path  # megatron-core keys its index cache on this
    return ds


class PatchGPTDataset(GPTDataset):
    """megatron-core GPTDataset reading through megatron_patch's IndexedDataset."""

    build_low_level_dataset = staticmethod(_our_reader)


class PatchBERTDataset(BERTMaskedWordPieceDataset):
    """megatron-core BERT dataset (15% masking, 80/10/10, NSP) reading through our IndexedDataset."""

    build_low_level_dataset = staticmethod(_our_reader)


def _check_impl(data_impl: str) -> None:
    if data_impl not in DATA_IMPLS:
        raise ValueError(f"--data-impl {data_impl!r}: choose one of {', '.join(DATA_IMPLS)}")


def _build(dataset_cls, config_cls, data_path, tokenizer, seq_length, num_samples, split, seed, data_impl,
           cache_dir, is_built_on_rank, **specific):
    """Every rank gets datasets (unless `is_built_on_rank` says otherwise); megatron-core's builder lets
    rank 0 write the index caches first while the other ranks wait, then read them."""
    _check_impl(data_impl)
    config = config_cls(random_seed=seed, sequence_length=seq_length, blend=parse_data_path(data_path), split=split,
                        path_to_cache=cache_dir, tokenizer=tokenizer, **specific)
    config.data_impl = data_impl
    return BlendedMegatronDatasetBuilder(dataset_cls, list(num_samples), is_built_on_rank or (lambda: True),
                                         config).build()


@contextlib.contextmanager
def _process_group():
    """megatron-core's BERT index builder calls torch.distributed.get_rank() unconditionally: outside a
    distributed run, give it a one-process gloo group for the duration of the build."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def build_gpt_datasets(
    data_path: Sequence[str],
    tokenizer,
    seq_length: int,
    num_samples: Tuple[int, int, int],
    split: str = "969,30,1",
    seed: int = 1234,
    data_impl: str = "mmap",
    cache_dir: Optional[str] = None,
    eod_mask_loss: bool = False,
    is_built_on_rank: Optional[Callable[[], bool]] = None,
):
    """(train, valid, test) GPT datasets of `num_samples` samples each (None where a split is empty)."""
    return _build(PatchGPTDataset, GPTDatasetConfig, data_path, tokenizer, seq_length, num_samples, split, seed,
                  data_impl, cache_dir, is_built_on_rank, reset_position_ids=False, reset_attention_mask=False,
                  eod_mask_loss=eod_mask_loss, create_attention_mask=False)


def build_bert_datasets(
    data_path: Sequence[str],
    tokenizer,
    seq_length: int,
    num_samples: Tuple[int, int, int],
    split: str = "969,30,1",
    seed: int = 1234,
    data_impl: str = "mmap",
    cache_dir: Optional[str] = None,
    masking_probability: float = 0.15,
    short_seq_prob: float = 0.1,
    binary_head: bool = True,
    is_built_on_rank: Optional[Callable[[], bool]] = None,
):
    """(train, valid, test) BERT datasets from sentence-split data (`--split-sentences`)."""
    with _process_group():
        return _build(PatchBERTDataset, BERTMaskedWordPieceDatasetConfig, data_path, tokenizer, seq_length,
                      num_samples, split, seed, data_impl, cache_dir, is_built_on_rank,
                      masking_probability=masking_probability, short_sequence_probability=short_seq_prob,
                      masking_max_ngram=3, masking_do_full_word=True, masking_do_permutation=False,
                      masking_use_longer_ngrams=False, masking_use_geometric_distribution=False,
                      classification_head=binary_head)
