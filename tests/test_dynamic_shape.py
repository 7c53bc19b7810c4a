"""--data-iterator dynamic-shape: less padding than fixed-shape, and the same tokens."""
import numpy as np
import pytest

from conftest import run_tool
from megatron_patch.data.dynamic_shape import DocumentSamples, VariableLengthBatches, make_batches
from megatron_patch.data.indexed_dataset import IndexedDataset


@pytest.fixture(scope="module")
def documents(corpus, gpt2_files, workdir):
    prefix = str(workdir / "dyn")
    run_tool("preprocess_data.py", "--input", corpus, "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
             "--vocab-file", gpt2_files[0], "--merge-file", gpt2_files[1], "--append-eod")
    return DocumentSamples(IndexedDataset(prefix + "_text_document"))


def _collect(batches):
    rows = []
    for b in batches:
        for r in range(b["tokens"].shape[0]):
            n = int(b["loss_mask"][r].sum())
            rows.append(tuple(b["tokens"][r, :n].tolist()) + (int(b["labels"][r, n - 1]),))
    return sorted(rows)


@pytest.mark.parametrize("multiple", [8, 64])
def test_dynamic_shape_cuts_padding_and_keeps_tokens(documents, multiple):
    fixed = VariableLengthBatches(documents, "fixed-shape", 8, 512, pad_id=0, multiple=multiple)
    dyn = VariableLengthBatches(documents, "dynamic-shape", 8, 512, pad_id=0, multiple=multiple)
    f, d = fixed.stats(), dyn.stats()
    assert f.real_tokens == d.real_tokens
    assert d.padding_fraction < f.padding_fraction / 2, (f.padding_fraction, d.padding_fraction)
    fb, db = list(fixed), list(dyn)
    assert all(b["tokens"].shape[1] == 512 for b in fb)
    assert all(b["tokens"].shape[1] % multiple == 0 and b["tokens"].numel() <= 8 * 512 or b["tokens"].shape[0] == 1 for b in db)
    assert _collect(fb) == _collect(db)  # same samples, only the padding differs


def test_batches_cover_every_sample_once():
    lengths = np.random.default_rng(0).integers(1, 300, 1000)
    for it in ("fixed-shape", "dynamic-shape"):
        b = make_batches(lengths, it, 4, 256, 8, seed=1)
        assert sorted(np.concatenate(b).tolist()) == list(range(1000))
    with pytest.raises(ValueError, match="--data-iterator"):
        make_batches(lengths, "ragged", 4, 256)
