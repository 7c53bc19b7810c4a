"""GPT and BERT training samples through megatron-core's dataset builders on our files."""
import numpy as np
import pytest

from conftest import run_tool
from megatron_patch.data.datasets import build_bert_datasets, build_gpt_datasets, parse_data_path
from megatron_patch.data.indexed_dataset import IndexedDataset
from megatron_patch.data.tokenizers import build_tokenizer


@pytest.fixture(scope="module")
def gpt_data(corpus, gpt2_files, workdir):
    prefix = str(workdir / "gptds")
    run_tool("preprocess_data.py", "--input", corpus, "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
             "--vocab-file", gpt2_files[0], "--merge-file", gpt2_files[1], "--append-eod")
    return prefix + "_text_document"


@pytest.fixture(scope="module")
def gpt_tok(gpt2_files):
    return build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])


def _stream(prefix):
    ds = IndexedDataset(prefix)
    return np.concatenate([ds[i] for i in range(len(ds))])


@pytest.mark.parametrize("impl", ["mmap", "cached", "lazy", "infer"])
def test_gpt_samples_are_windows_of_the_token_stream(gpt_data, gpt_tok, tmp_path, impl):
    train, valid, test = build_gpt_datasets([gpt_data], gpt_tok, 64, (50, 10, 10), split="90,5,5",
                                            cache_dir=str(tmp_path), data_impl=impl)
    assert len(train) >= 50 and len(valid) >= 10 and len(test) >= 10
    stream = _stream(gpt_data).astype(np.int64)
    text = stream.tobytes()
    for i in range(5):
        s = train[i]
        assert s["tokens"].shape == (64,) and s["labels"].shape == (64,)
        assert (s["tokens"][1:] == s["labels"][:-1]).all()
        window = np.concatenate([s["tokens"].numpy(), s["labels"][-1:].numpy()])
        if gpt_tok.eod not in window[1:-1]:  # within one document: a contiguous slice of the corpus
            assert window.astype(np.int64).tobytes() in text
    assert list(tmp_path.iterdir()), "index caches are written to --data-cache-path"


def test_same_seed_same_samples_and_cache_reuse(gpt_data, gpt_tok, tmp_path):
    a = build_gpt_datasets([gpt_data], gpt_tok, 64, (20, 5, 5), cache_dir=str(tmp_path))[0]
    b = build_gpt_datasets([gpt_data], gpt_tok, 64, (20, 5, 5), cache_dir=str(tmp_path))[0]
    c = build_gpt_datasets([gpt_data], gpt_tok, 64, (20, 5, 5), cache_dir=str(tmp_path), seed=7)[0]
    assert all((a[i]["tokens"] == b[i]["tokens"]).all() for i in range(20))
    assert any((a[i]["tokens"] != c[i]["tokens"]).any() for i in range(20))


def test_blend_follows_weights(gpt_data, gpt_tok, workdir, tmp_path, corpus, gpt2_files):
    # A second corpus in which every token is the same few ids, to tell the sources apart.
    other = workdir / "other.jsonl"
    other.write_text("".join('{"text": "zzz zzz zzz zzz zzz zzz zzz zzz zzz zzz"}\n' for _ in range(3000)))
    run_tool("preprocess_data.py", "--input", str(other), "--output-prefix", str(workdir / "other"), "--tokenizer-type",
             "GPT2BPETokenizer", "--vocab-file", gpt2_files[0], "--merge-file", gpt2_files[1])
    other_ids = set(gpt_tok.tokenize("zzz zzz"))
    train = build_gpt_datasets(["0.3", gpt_data, "0.7", str(workdir / "other_text_document")], gpt_tok, 32,
                               (400, 10, 10), cache_dir=str(tmp_path))[0]
    from_other = sum(set(train[i]["tokens"].tolist()) <= other_ids for i in range(len(train)))
    assert abs(from_other / len(train) - 0.7) < 0.05


def test_parse_data_path_errors(gpt_data):
    assert parse_data_path([gpt_data]) == ([gpt_data], None)
    assert parse_data_path(["1", gpt_data, "3", gpt_data]) == ([gpt_data, gpt_data], [1.0, 3.0])
    with pytest.raises(ValueError, match="pairs"):
        parse_data_path(["1", gpt_data, "3"])
    with pytest.raises(FileNotFoundError, match="without .bin/.idx"):
        parse_data_path([gpt_data + ".bin"])
    with pytest.raises(ValueError, match="--data-impl"):
        build_gpt_datasets([gpt_data], None, 8, (1, 1, 1), data_impl="fast")


def test_bert_masked_lm_and_next_sentence(corpus, minilm_vocab, workdir, tmp_path):
    prefix = str(workdir / "bertds")
    run_tool("preprocess_data.py", "--input", corpus, "--output-prefix", prefix, "--tokenizer-type",
             "BertWordPieceLowerCase", "--vocab-file", minilm_vocab, "--split-sentences")
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=minilm_vocab)
    train = build_bert_datasets([prefix + "_text_sentence"], tok, 128, (300, 10, 10), cache_dir=str(tmp_path))[0]
    masked = real = as_mask = kept = random_next = 0
    for i in range(300):
        s = train[i]
        n = int((s["padding_mask"] == 1).sum())
        assert s["text"][0] == tok.cls and (s["text"][:n] == tok.sep).sum() == 2
        lm = s["loss_mask"].astype(bool)
        assert (s["labels"][lm] >= 0).all() and (s["labels"][~lm] == -1).all()
        masked += lm.sum()
        real += n - 3
        as_mask += (s["text"][lm] == tok.mask).sum()
        kept += (s["text"][lm] == s["labels"][lm]).sum()
        random_next += s["is_random"]
    assert 0.13 < masked / real < 0.17  # 15% of tokens are predicted
    assert 0.75 < as_mask / masked < 0.85  # 80% of them shown as [MASK]
    assert 0.06 < kept / masked < 0.14  # 10% left unchanged (the other 10% random)
    assert 0.4 < random_next / 300 < 0.6  # next-sentence labels balanced
