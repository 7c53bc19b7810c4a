"""Training datasets on megatron-core: GPT samples (GPTDataset) and BERT masked-LM + next-sentence
samples (BERTMaskedWordPieceDataset), built by BlendedMegatronDatasetBuilder with blending
(`--data-path 0.3 a 0.7 b`), `--split 969,30,1` and index caches on disk.

megatron-core always opens data through its own reader; the subclasses here open it through ours,
so `--data-impl mmap|cached|lazy|infer` is honoured and a corrupt file is refused with a clear message.
Before building, the data is checked (`megatron_patch.data.checks`): every prefix exists, every token id
is inside the tokenizer's vocabulary, and (GPT) every split with a weight gets tokens.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Callable, Optional, Sequence, Tuple

from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from .checks import DataError, check_bert_documents, check_split_sizes, check_token_ids, parse_data_path
from .indexed_dataset import DATA_IMPLS, IndexedDataset

__all__ = ["DataError", "build_bert_datasets", "build_gpt_datasets", "parse_data_path"]


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
    blend = parse_data_path(data_path)
    check_token_ids(blend[0], tokenizer.vocab_size, cache_dir)
    if dataset_cls is PatchGPTDataset:  # GPT splits by sequence (BERT by document)
        check_split_sizes(blend[0], split)
    else:
        check_bert_documents(blend[0], split, specific["classification_head"])
    config = config_cls(random_seed=seed, sequence_length=seq_length, blend=blend, split=split,
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
