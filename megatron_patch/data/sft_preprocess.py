"""Chat conversations (JSONL) -> tokens and a loss mask in Megatron's indexed format, for supervised fine-tuning:
`tools/preprocess_data.py --sft`.

Input lines are `{"messages": [{"role": ..., "content": ...}, ...]}` or `{"prompt": ..., "response": ...}` (plus
`--system-prompt`, which is also put before a `messages` conversation that has no system turn). Each
conversation is rendered with the model's own chat template (the `chat_template` of the tokenizer directory's
tokenizer_config.json, through transformers' `apply_chat_template`, or `--chat-template FILE|chatml`) and tokenized
as the template wrote it: no BOS/EOS is added beyond the template's own.

The loss mask marks the tokens of the assistant turns. Their spans come from the rendered text: the span of
assistant turn i is what rendering messages[:i+1] adds to rendering messages[:i] with the generation prompt, so it
holds the answer and the template's end-of-turn marker (the model learns to stop); when a template does not render
prefixes that way (templates that rewrite earlier turns), the answer's text is found in the rendering and the
end-of-turn marker (eos_token) after it is included when present. A token is in the mask when its first character is.

Output: `{prefix}_text_document.bin/.idx` (token ids) and `{prefix}_loss_mask_document.bin/.idx` (uint8, 1 on
assistant tokens), one document per conversation, same lengths. A conversation longer than `--seq-length` is
truncated (`--overflow truncate`, the default) or dropped (`drop`); one that truncation leaves without an assistant
token to learn is dropped; the summary line counts both.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .indexed_dataset import IndexedDatasetWriter, optimal_dtype
from .preprocess_input import PreprocessError, resolve_inputs

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ROLES = ("system", "user", "assistant", "tool")


def mask_prefix(text_prefix: str) -> str:
    """The loss-mask dataset that belongs to an SFT token dataset `..._text_document`."""
    if not text_prefix.endswith("_text_document"):
        raise ValueError(f"{text_prefix}: an SFT dataset prefix ends in _text_document (preprocess_data.py --sft writes "
                         f"PREFIX_text_document and PREFIX_loss_mask_document)")
    return text_prefix[: -len("_text_document")] + "_loss_mask_document"


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="preprocess_data.py --sft",
                                description="Render chat conversations with a chat template into tokens + loss mask.")
    p.add_argument("--sft", action="store_true", required=True, help="supervised fine-tuning data (this mode)")
    p.add_argument("--input", required=True, help="JSONL file, directory of .json/.jsonl files, or glob")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_text_document and PREFIX_loss_mask_document")
    p.add_argument("--tokenizer-model", required=True,
                   help="local Hugging Face model or tokenizer directory (tokenizer.json, tokenizer_config.json)")
    p.add_argument("--tokenizer-type", default="HuggingFaceTokenizer", choices=["HuggingFaceTokenizer"],
                   help="SFT renders with transformers' chat templates: HuggingFaceTokenizer only")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file, or 'chatml', instead of the tokenizer's own")
    p.add_argument("--system-prompt", default=None, help="system turn put before conversations that have none")
    p.add_argument("--seq-length", type=int, required=True, help="longest conversation kept, in tokens")
    p.add_argument("--overflow", choices=["truncate", "drop"], default="truncate",
                   help="a conversation longer than --seq-length: cut it there (default) or drop it")
    p.add_argument("--log-interval", type=int, default=1000, help="report progress every this many conversations")
    a = p.parse_args(argv)
    if a.seq_length < 2:
        p.error("--seq-length must be at least 2")
    return a


def load_tokenizer(directory: str, chat_template: Optional[str]):
    """The directory's fast tokenizer with the chat template to use (PreprocessError naming the fix otherwise)."""
    if not os.path.isdir(directory):
        raise PreprocessError(f"--tokenizer-model {directory}: not a directory (a local save_pretrained() directory; "
                              f"nothing is downloaded)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:  # transformers' errors name neither the flag nor the fix
        raise PreprocessError(f"--tokenizer-model {directory}: no tokenizer could be loaded "
                              f"({' '.join(str(e).split())[:200]})") from None
    if not tok.is_fast:
        raise PreprocessError(f"--tokenizer-model {directory}: a fast tokenizer (tokenizer.json) is needed for the "
                              f"character offsets of the loss mask")
    if chat_template == "chatml":
        tok.chat_template = CHATML
    elif chat_template is not None:
        try:
            with open(chat_template, encoding="utf-8") as f:
                tok.chat_template = f.read()
        except OSError as e:
            raise PreprocessError(f"--chat-template {chat_template}: cannot read it ({e.strerror or e}); give a Jinja "
                                  f"template file or 'chatml'") from None
    if not tok.chat_template:
        raise PreprocessError(f"--tokenizer-model {directory} has no chat template (tokenizer_config.json's "
                              f"chat_template): pass --chat-template FILE (Jinja) or --chat-template chatml")
    return tok


def conversation(record, where: str, system_prompt: Optional[str]) -> List[Dict[str, str]]:
    """The messages of one input record, checked; PreprocessError naming `where` (file:line) otherwise."""
    if not isinstance(record, dict):
        raise PreprocessError(f"{where}: a line must be a JSON object with \"messages\" or \"prompt\"/\"response\"")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise PreprocessError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise PreprocessError(f"{where}: message {i} must be an object with string \"role\" and \"content\"")
            if m["role"] not in ROLES:
                raise PreprocessError(f"{where}: message {i} has role {m['role']!r}; use one of {', '.join(ROLES)}")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    elif "prompt" in record or "response" in record:
        if not isinstance(record.get("prompt"), str) or not isinstance(record.get("response"), str):
            raise PreprocessError(f"{where}: \"prompt\" and \"response\" must both be strings")
        messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    else:
        raise PreprocessError(f"{where}: no \"messages\" and no \"prompt\"/\"response\" (keys: {sorted(record)})")
    if not any(m["role"] == "assistant" for m in messages):
        raise PreprocessError(f"{where}: the conversation has no assistant turn, so nothing would be learned from it; "
                              f"remove the line or add the answer")
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def assistant_spans(tok, messages: List[Dict[str, str]]) -> Tuple[str, List[Tuple[int, int]]]:
    """The rendered conversation and the character spans [start, end) of its assistant turns."""
    def render(msgs, generation_prompt=False):
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)

    text = render(messages)
    spans, searched = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:i], True) if i else "", render(messages[: i + 1])
        if i and through.startswith(before) and text.startswith(through) and len(through) > len(before):
            spans.append((len(before), len(through)))
        else:  # the template rewrites earlier turns: find the answer in the full rendering
            start = text.find(m["content"], searched)
            if start < 0:
                raise PreprocessError(f"the chat template does not reproduce assistant message {i}'s text")
            end = start + len(m["content"])
            eos = tok.eos_token or ""
            if eos and text.startswith(eos, end):
                end += len(eos)
            spans.append((start, end))
        searched = spans[-1][1]
    return text, spans


def encode(tok, messages: List[Dict[str, str]]) -> Tuple[np.ndarray, np.ndarray]:
    """(token ids, loss mask) of one conversation: mask 1 on the tokens that start inside an assistant span."""
    text, spans = assistant_spans(tok, messages)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return ids, mask


@dataclass
class SFTTotals:
    conversations: int = 0
    tokens: int = 0
    assistant_tokens: int = 0
    truncated: int = 0
    dropped: int = 0
    first_dropped: Optional[str] = None
    longest: int = 0


def write_sft(args: argparse.Namespace, files: Sequence[str], tok) -> SFTTotals:
    totals, t0 = SFTTotals(), time.time()
    dtype = optimal_dtype(len(tok))
    with IndexedDatasetWriter(f"{args.output_prefix}_text_document", dtype) as tokens_out, \
            IndexedDatasetWriter(f"{args.output_prefix}_loss_mask_document", np.uint8) as mask_out:
        for path in files:
            with open(path, "rb") as f:
                for lineno, raw in enumerate(f, 1):
                    where = f"{path}:{lineno}"
                    if not raw.strip():
                        continue
                    try:
                        record = json.loads(raw.decode("utf-8"))
                    except (UnicodeDecodeError, json.JSONDecodeError) as e:
                        raise PreprocessError(f"{where}: not a UTF-8 JSON line ({e}); fix or remove the line") from None
                    messages = conversation(record, where, args.system_prompt)
                    try:
                        ids, mask = encode(tok, messages)
                    except PreprocessError as e:
                        raise PreprocessError(f"{where}: {e}") from None
                    except Exception as e:  # a template raising (e.g. its own role checks) names no line
                        raise PreprocessError(f"{where}: the chat template failed on this conversation "
                                              f"({' '.join(str(e).split())[:200]})") from None
                    if len(ids) > args.seq_length:
                        ids, mask = ids[: args.seq_length], mask[: args.seq_length]
                        if args.overflow == "drop" or not mask[1:].any():  # truncated, nothing is left to learn
                            totals.dropped += 1
                            totals.first_dropped = totals.first_dropped or where
                            continue
                        totals.truncated += 1
                    tokens_out.add_document([ids])
                    mask_out.add_document([mask])
                    totals.conversations += 1
                    totals.tokens += len(ids)
                    totals.assistant_tokens += int(mask.sum())
                    totals.longest = max(totals.longest, len(ids))
                    if args.log_interval and totals.conversations % args.log_interval == 0:
                        print(f"processed {totals.conversations} conversations ({totals.conversations / max(time.time() - t0, 1e-9):.0f}/s)",
                              file=sys.stderr, flush=True)
        if not totals.conversations:
            raise PreprocessError(f"--input {args.input}: no conversation was kept ({totals.dropped} dropped by "
                                  f"--overflow {args.overflow} at --seq-length {args.seq_length}); nothing written")
        tokens_out.finalize()
        mask_out.finalize()
    return totals


def preprocess_sft(args: argparse.Namespace) -> SFTTotals:
    """Run the SFT conversion; return the counts (also printed). Bad input or flags raise PreprocessError."""
    files = resolve_inputs(args.input)
    tok = load_tokenizer(args.tokenizer_model, args.chat_template)
    t0 = time.time()
    totals = write_sft(args, files, tok)
    share = totals.assistant_tokens / max(totals.tokens, 1)
    print(f"done: {totals.conversations} conversations, {totals.tokens} tokens ({totals.assistant_tokens} assistant "
          f"tokens in the loss, {share:.0%}), longest {totals.longest}; {totals.truncated} truncated and "
          f"{totals.dropped} dropped at --seq-length {args.seq_length} (--overflow {args.overflow})"
          f"{'; first dropped: ' + totals.first_dropped if totals.first_dropped else ''}; {time.time() - t0:.1f} s",
          file=sys.stderr)
    for kind in ("text", "loss_mask"):
        print(f"wrote {args.output_prefix}_{kind}_document.bin and .idx", file=sys.stderr)
    return totals


def main(argv: Optional[List[str]] = None) -> None:
    try:
        preprocess_sft(get_args(argv))
    except PreprocessError as e:
        sys.exit(f"error: {e}")
