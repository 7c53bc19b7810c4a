"""Train a tokenizer on local text, since no vocabulary can be downloaded here.

  --type gpt2           GPT-2 style byte-level BPE: {prefix}-vocab.json + {prefix}-merges.txt
                        (load with --tokenizer-type GPT2BPETokenizer)
  --type sentencepiece  {prefix}.model (load with --tokenizer-type SentencePieceTokenizer)
  --type wordpiece      {prefix}-vocab.txt, BERT style (load with --tokenizer-type BertWordPieceLowerCase)
  --type llama3         a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json) in Llama 3's style:
                        byte-level BPE after its tiktoken split pattern (digits in groups of up to 3),
                        <|begin_of_text|> as BOS and <|end_of_text|> as EOS (the document separator)
  --type qwen           the same in Qwen2/2.5/3's style: digits one by one, <|endoftext|> as EOS and padding, no BOS,
                        <|im_start|>/<|im_end|> and a ChatML chat template
                        (load either with --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR)

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
    if kind in HF_STYLES:
        return _train_hf_style(kind, texts, output_dir, vocab_size)
    raise ValueError(f"--type {kind!r}: choose {', '.join(KINDS)}")


# The split patterns of Llama 3's and Qwen2's tokenizer.json (public): they differ in how digits group
_LETTERS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
HF_STYLES = {
    "llama3": dict(pattern=_LETTERS + r"\p{N}{1,3}" + _REST, bos="<|begin_of_text|>", eos="<|end_of_text|>",
                   specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                             "<|eot_id|>"], pad=None, chat_template=None),
    "qwen": dict(pattern=_LETTERS + r"\p{N}" + _REST, bos=None, eos="<|endoftext|>",
                 specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], pad="<|endoftext|>",
                 chat_template="{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
}
KINDS = ("gpt2", "sentencepiece", "wordpiece", *HF_STYLES)


def _train_hf_style(kind: str, texts: Iterator[str], output_dir: str, vocab_size: int) -> List[str]:
    """A byte-level BPE in the style of `kind` (HF_STYLES), saved as a Hugging Face tokenizer directory."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    style = HF_STYLES[kind]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(style["pattern"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=style["specials"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if style["bos"]:  # Llama 3 puts BOS before every encoded text (add_special_tokens=True)
        bos = style["bos"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=style["bos"], eos_token=style["eos"],
                                   pad_token=style["pad"], clean_up_tokenization_spaces=False)
    if style["chat_template"]:
        fast.chat_template = style["chat_template"]
    return [f for f in fast.save_pretrained(output_dir) if os.path.isfile(f)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--type", required=True, choices=KINDS)
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
