"""The .bin/.idx format: interchangeable with megatron-core both ways, four readers, corrupt files refused."""
import os

import numpy as np
import pytest
import torch

from megatron_patch.data.indexed_dataset import (
    HEADER, MAGIC, CorruptIndexError, IndexedDataset, IndexedDatasetWriter, optimal_dtype,
)


def random_docs(rng, n_docs=50, vocab=60000):
    return [[rng.integers(0, vocab, rng.integers(0, 40)).tolist() for _ in range(rng.integers(1, 4))] for _ in range(n_docs)]


def write_ours(prefix, docs, dtype):
    w = IndexedDatasetWriter(prefix, dtype)
    for d in docs:
        w.add_document(d)
    w.finalize()


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_core_reads_ours(tmp_path, dtype):
    from megatron.core.datasets.indexed_dataset import IndexedDataset as CoreDataset

    rng = np.random.default_rng(0)
    docs = random_docs(rng)
    prefix = str(tmp_path / "ours")
    write_ours(prefix, docs, dtype)
    core = CoreDataset(prefix)
    flat = [s for d in docs for s in d]
    assert len(core) == len(flat)
    for i, s in enumerate(flat):
        assert core[i].tolist() == s
        assert core[i].dtype == dtype
    expected_docs = np.cumsum([0] + [len(d) for d in docs])
    assert core.document_indices.tolist() == expected_docs.tolist()


@pytest.mark.parametrize("impl", ["mmap", "cached", "lazy", "infer"])
def test_we_read_megatron_core_output_byte_for_byte(tmp_path, impl):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(1)
    docs = random_docs(rng)
    core_prefix, our_prefix = str(tmp_path / "core"), str(tmp_path / "ours")
    b = IndexedDatasetBuilder(core_prefix + ".bin", dtype=np.uint16)
    for d in docs:
        b.add_document(torch.tensor([t for s in d for t in s], dtype=torch.int64), [len(s) for s in d])
    b.finalize(core_prefix + ".idx")
    ds = IndexedDataset(core_prefix, impl=impl)
    flat = [s for d in docs for s in d]
    assert [ds[i].tolist() for i in range(len(ds))] == flat
    assert ds.num_documents == len(docs)
    assert ds.get(0, 1, 2).tolist() == flat[0][1:3]
    # Same content written by us: the files are identical.
    write_ours(our_prefix, docs, np.uint16)
    for ext in (".bin", ".idx"):
        with open(core_prefix + ext, "rb") as a, open(our_prefix + ext, "rb") as c:
            assert a.read() == c.read(), ext


def test_optimal_dtype():
    assert optimal_dtype(50257) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(None) == np.int32


@pytest.fixture
def pair(tmp_path):
    prefix = str(tmp_path / "p")
    write_ours(prefix, [[[1, 2, 3], [4]], [[5, 6]]], np.uint16)
    return prefix


def test_truncated_bin_refused(pair):
    with open(pair + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(pair + ".bin") - 2)
    with pytest.raises(CorruptIndexError, match=r"p\.bin.*truncated"):
        IndexedDataset(pair)


def test_truncated_idx_refused(pair):
    with open(pair + ".idx", "r+b") as f:
        f.truncate(os.path.getsize(pair + ".idx") - 8)
    with pytest.raises(CorruptIndexError, match=r"p\.idx.*truncated or corrupt"):
        IndexedDataset(pair, impl="lazy")


def test_wrong_magic_refused(pair):
    with open(pair + ".idx", "r+b") as f:
        f.write(b"TNTIDX\x00\x00\x00")
    with pytest.raises(CorruptIndexError, match=r"p\.idx: wrong magic"):
        IndexedDataset(pair, impl="infer")


def test_header_only_and_missing_files(pair, tmp_path):
    with open(pair + ".idx", "r+b") as f:
        f.truncate(5)
    with pytest.raises(CorruptIndexError, match="shorter than"):
        IndexedDataset(pair)
    with pytest.raises(FileNotFoundError, match="no such index file"):
        IndexedDataset(str(tmp_path / "absent"))


def test_bad_impl(pair):
    with pytest.raises(ValueError, match="--data-impl"):
        IndexedDataset(pair, impl="fast")


def test_add_index_merges(tmp_path, pair):
    out = str(tmp_path / "merged")
    w = IndexedDatasetWriter(out, np.uint16)
    w.add_index(pair)
    w.add_index(pair)
    w.finalize()
    ds = IndexedDataset(out)
    assert [x.tolist() for x in ds[:]] == [[1, 2, 3], [4], [5, 6]] * 2
    assert ds.document_indices.tolist() == [0, 2, 3, 5, 6]
    assert HEADER.unpack(open(out + ".idx", "rb").read(HEADER.size))[0] == MAGIC


def _as_list(batch):
    return batch


# The fork is the point of the test (workers sharing the reader's file descriptor); Python warns about any fork of a
# process with threads (torch's), which is harmless here: the workers only read.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_lazy_reader_in_forked_dataloader_workers(tmp_path):
    """Every item, read through a DataLoader with 2 forked workers over one lazy reader, equals mmap's.

    The reader is opened before the fork, so both workers share its file descriptor and file offset:
    with seek-then-read one worker's seek can move the other's read. Random order (every read misses
    the file object's buffer) and many small items per batch keep both workers reading at once.
    """
    rng = np.random.default_rng(3)
    n = 40_000
    lengths = rng.integers(1, 8, n).astype(np.int32)
    prefix = str(tmp_path / "many_small")
    w = IndexedDatasetWriter(prefix, np.int32)
    w.add_documents(rng.integers(0, 2**31 - 1, int(lengths.sum())).astype(np.int32), lengths, np.ones(n, np.int64))
    w.finalize()
    lazy, mmap = IndexedDataset(prefix, impl="lazy"), IndexedDataset(prefix, impl="mmap")
    order = rng.permutation(n).tolist()
    loader = torch.utils.data.DataLoader(lazy, sampler=order, batch_size=2000, num_workers=2,
                                         multiprocessing_context="fork", collate_fn=_as_list)
    got = [item for batch in loader for item in batch]
    assert len(got) == n
    wrong = [i for i, item in zip(order, got) if not np.array_equal(item, mmap[i])]
    assert not wrong, f"{len(wrong)} of {n} items read wrong through the lazy reader, first: {wrong[:5]}"
