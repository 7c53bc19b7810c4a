"""The C++ packing and bucketing helpers equal their plain-Python definitions."""
import numpy as np
import pytest

from megatron_patch.data.packing import (
    bins_to_groups, bucket_by_length, bucket_by_length_reference, pack_documents, pack_documents_reference,
)


@pytest.mark.parametrize("n,cap,seed", [(0, 16, 0), (1, 16, 1), (7, 10, 2), (500, 2048, 3), (3000, 4096, 4)])
def test_pack_equals_reference(n, cap, seed):
    lengths = np.random.default_rng(seed).integers(0, cap + 1, n)
    got = pack_documents(lengths, cap)
    assert np.array_equal(got, pack_documents_reference(lengths, cap))
    fill = np.bincount(got, weights=lengths, minlength=got.max() + 1 if n else 0)
    assert (fill <= cap).all()
    if n:  # best fit decreasing stays within 11/9 OPT + 1 bins; OPT >= total / cap
        assert got.max() + 1 <= 11 / 9 * np.ceil(lengths.sum() / cap) + 1


def test_pack_ties_and_groups():
    bins = pack_documents([5, 5, 5, 5], 10)
    assert bins.tolist() == [0, 0, 1, 1]
    assert [g.tolist() for g in bins_to_groups(bins)] == [[0, 1], [2, 3]]


def test_pack_rejects_oversized_document():
    with pytest.raises(ValueError, match="document 1 has length 11"):
        pack_documents([3, 11], 10)
    with pytest.raises(ValueError, match="document 1 has length 11"):
        pack_documents_reference([3, 11], 10)


@pytest.mark.parametrize("multiple,cap,seed", [(8, 4096, 0), (64, 8192, 1), (1, 100, 2), (8, 4096, 3)])
def test_bucket_equals_reference(multiple, cap, seed):
    lengths = np.random.default_rng(seed).integers(1, 1025, 2000)
    for max_bs in (0, 4):
        got = bucket_by_length(lengths, cap, multiple, max_bs)
        ref = bucket_by_length_reference(lengths, cap, multiple, max_bs)
        assert len(got) == len(ref) and all(np.array_equal(a, b) for a, b in zip(got, ref))
        assert sorted(np.concatenate(got).tolist()) == list(range(len(lengths)))
        for b in got:
            padded = -(-lengths[b].max() // multiple) * multiple
            assert len(b) == 1 or len(b) * padded <= cap
            assert max_bs == 0 or len(b) <= max_bs
