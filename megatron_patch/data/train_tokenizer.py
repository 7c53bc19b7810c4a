"""Train a tokenizer on local text, since no vocabulary can be downloaded here.

  --type gpt2           GPT-2 style byte-level BPE: {prefix}-vocab.json + {prefix}-merges.txt
                        (load with --tokenizer-type GPT2BPETokenizer)
  --type sentencepiece  {prefix}.model (load with --tokenizer-type SentencePieceTokenizer)
  --type wordpiece      {prefix}-vocab.txt, BERT style (load with --tokenizer-type BertWordPieceLowerCase)

Input: JSONL files (the --json-key field of each line) or plain text files (one document per line).
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Iterator, List


def iter_texts(paths: List[str], json_key: str = "text") -> Iterator[str]:
    """Documents of JSONL (.json/.jsonl) or plain-text files, with file:line on bad JSON."""
    for path in paths:
        is_json = path.endswith((".json", ".jsonl"))
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if not is_json:
                    yield line.rstrip("\n")
                    continue
                try:
                    yield json.loads(line)[json_key]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: not a JSON object with key {json_key!r} ({e})") from None


def train(kind: str, inputs: List[str], output_dir: str, vocab_size: int, prefix: str, json_key: str = "text") -> List[str]:
    """Train and save; return the written file paths."""
    os.makedirs(output_dir, exist_ok=True)
    texts = iter_texts(inputs, json_key)
    if kind == "gpt2":
        from tokenizers import ByteLevelBPETokenizer

        tok = ByteLevelBPETokenizer(add_prefix_space=False)
        tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2,
                                special_tokens=["<|endoftext|>"], show_progress=False)
        return tok.save_model(output_dir, prefix)
    if kind == "wordpiece":
        from tokenizers import BertWordPieceTokenizer

        tok = BertWordPieceTokenizer(lowercase=True)
        tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
        return tok.save_model(output_dir, prefix)
    if kind == "sentencepiece":
        import sentencepiece as spm

        model_prefix = os.path.join(output_dir, prefix)
        spm.SentencePieceTrainer.train(
            sentence_iterator=texts, model_prefix=model_prefix, vocab_size=vocab_size, model_type="bpe",
            # Llama-style: no text normalisation, digits split, unknown bytes as <0xNN> pieces.
            character_coverage=1.0, byte_fallback=True, pad_id=3, minloglevel=2, split_digits=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            max_sentence_length=1 << 20,
        )
        return [model_prefix + ".model", model_prefix + ".vocab"]
    raise ValueError(f"--type {kind!r}: choose gpt2, sentencepiece or wordpiece")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--type", required=True, choices=["gpt2", "sentencepiece", "wordpiece"])
    p.add_argument("--input", required=True, nargs="+", help="JSONL or text files")
    p.add_argument("--json-key", default="text")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--output-prefix", default=None, help="file name prefix (default: the --type)")
    a = p.parse_args(argv)
    for path in a.input:
        if not os.path.isfile(path):
            p.error(f"--input {path}: no such file")
    files = train(a.type, a.input, a.output_dir, a.vocab_size, a.output_prefix or a.type, a.json_key)
    print("wrote " + ", ".join(files))


if __name__ == "__main__":
    main()
