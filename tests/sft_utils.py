"""Shared by the SFT tests: a chat set built offline, a Qwen-style tokenizer trained on it, and its
`preprocess_data.py --sft` output, trimmed so that a global batch can hold every training conversation packed."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

from conftest import run_tool

SEQ = 128  # the samples' length; conversations are 10-128 tokens, 2-4 per packed sample


def build_sft_data(d, count: int = 200, conversations: int = 16) -> SimpleNamespace:
    """Tokenizer + SFT dataset of at least `conversations` conversations of 10-SEQ tokens whose best-fit-decreasing
    packing into SEQ-token samples gives an even number of samples, fewer than half the conversations (packed and
    padded global batches then hold the same conversations: all of them)."""
    from megatron_patch.data.packing import pack_documents
    from megatron_patch.data.sft_preprocess import conversation, encode, load_tokenizer
    from megatron_patch.data.train_tokenizer import train
    from megatron_patch.demo.chats import write, write_texts

    d = os.path.abspath(str(d))
    os.makedirs(d, exist_ok=True)
    chats = os.path.join(d, "chats.jsonl")
    write(chats, count, seed=1)
    tok = os.path.join(d, "tok")
    write_texts(chats, os.path.join(d, "text.jsonl"))
    train("qwen", [os.path.join(d, "text.jsonl")], tok, 600, "")
    tokenizer = load_tokenizer(tok, None)
    lines, lengths = [], []
    for line in open(chats).read().splitlines():
        n = len(encode(tokenizer, conversation(json.loads(line), "", None))[0])
        if 10 <= n <= SEQ:
            lines.append(line)
            lengths.append(n)
    for n in range(conversations, len(lines)):
        bins = int(pack_documents(lengths[:n], SEQ).max()) + 1
        if n % 4 == 0 and bins % 2 == 0 and bins <= n // 2:
            break
    else:
        raise AssertionError("no subset of the chat set packs into an even number of samples")
    subset = os.path.join(d, "subset.jsonl")
    with open(subset, "w") as f:
        f.write("\n".join(lines[:n]) + "\n")
    prefix = os.path.join(d, "sft")
    run_tool("preprocess_data.py", "--sft", "--input", subset, "--tokenizer-model", tok, "--output-prefix", prefix,
             "--seq-length", str(SEQ), "--log-interval", "0")
    from megatron_patch.data.indexed_dataset import IndexedDataset

    assert IndexedDataset(prefix + "_text_document").sequence_lengths.tolist() == lengths[:n]
    return SimpleNamespace(tok=tok, prefix=prefix + "_text_document", conversations=n, packed_samples=bins)


def sft_flags(data: SimpleNamespace, *extra: str) -> list:
    """Engine flags for a tiny Qwen2-style model fine-tuned on `data` (every conversation in the training split)."""
    return ["--model-family", "qwen2", "--model-size", "tiny", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "128",
            "--data-path", data.prefix, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", data.tok,
            "--sft", "--seq-length", str(SEQ), "--split", "100,0,0", "--eval-iters", "0", "--train-iters", "5",
            "--lr", "3e-3", "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--init-layout-invariant", "--seed", "5", *extra]
