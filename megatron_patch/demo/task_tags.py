"""Tokens and BIO tags for the token-classification and question-answering demo corpora (task_corpora).

Tokens are whitespace words with quotes, brackets and punctuation split off (`word_spans`). Tags follow
CoNLL's BIO scheme with the names TAG_NAMES: CODE marks identifiers (`os.path.join()`, `max_size`,
`SequenceMatcher`, a call with its arguments as B-CODE I-CODE...); NUM marks numbers.
"""
from __future__ import annotations

import re

TAG_NAMES = ["O", "B-CODE", "I-CODE", "B-NUM"]
O, B_CODE, I_CODE, B_NUM = range(4)
_IDENT = re.compile(r"\.?[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\(\))?")  # .attr: an attribute
_CALL = re.compile(r"\.?[A-Za-z_][\w.]*\(")  # a call written with its arguments: f(x, y)
_CAMEL = re.compile(r"[A-Z]?[a-z]+[A-Z]\w*|[A-Z]{2,}[a-z]\w*")  # SequenceMatcher, getLogger, HTTPServer
_NUM = re.compile(r"[-+]?(?:0[xXoObB][0-9a-fA-F_]+|\d[\d_]*(?:\.\d+)?(?:[eE][-+]?\d+)?)")
LEAD = "\"'`([{"
TRAIL = ".,;:!?\"'`"  # punctuation split off a word's ends
_CLOSERS = {")": "(", "]": "[", "}": "{"}
MAX_CALL_TOKENS = 12  # an unbalanced "f(" tags at most this many tokens as I-CODE


def word_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each token: whitespace words with quotes, brackets and punctuation split off.

    `os.path.join(),` gives `os.path.join()` and `,`; `(see` gives `(` and `see`; a closing bracket stays
    on a word only when the word opened it (`f(x)` stays whole, `below)` gives `below` and `)`).
    """
    spans = []
    for m in re.finditer(r"\S+", text):
        i, j = m.start(), m.end()
        lead, trail = [], []
        while i < j and text[i] in LEAD:
            lead.append((i, i + 1))
            i += 1
        while j > i:
            c, word = text[j - 1], text[i:j]
            if c in TRAIL or (c in _CLOSERS and word.count(_CLOSERS[c]) < word.count(c)):
                trail.append((j - 1, j))
                j -= 1
            else:
                break
        spans += lead + ([(i, j)] if j > i else []) + trail[::-1]
    return spans


def _is_code(token: str) -> bool:
    if _CALL.match(token):
        return True
    if not _IDENT.fullmatch(token):
        return False
    parts = token[:-2].split(".") if token.endswith("()") else token.split(".")
    dotted = len(parts) > 1 and any(len(p) > 1 for p in parts)  # os.path yes, e.g / i.e no
    return "_" in token or token.endswith("()") or dotted or _CAMEL.fullmatch(token) is not None


def tag_tokens(tokens: list[str]) -> list[int]:
    """BIO tag ids (TAG_NAMES) for `tokens`: identifiers are CODE, a call's arguments I-CODE, numbers NUM."""
    tags, depth, left = [], 0, 0
    for tok in tokens:
        if depth > 0 and left > 0:  # inside the arguments of a call started by an earlier token
            tags.append(I_CODE)
            depth += tok.count("(") - tok.count(")")
            left -= 1
            continue
        depth = 0
        if _is_code(tok):
            tags.append(B_CODE)
            depth, left = tok.count("(") - tok.count(")"), MAX_CALL_TOKENS
        elif _NUM.fullmatch(tok):
            tags.append(B_NUM)
        else:
            tags.append(O)
    return tags


def entity_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, "CODE"|"NUM") in `text` of each tagged span (B-CODE with its I-CODE tokens, B-NUM)."""
    spans = word_spans(text)
    tags = tag_tokens([text[a:b] for a, b in spans])
    out = []
    for k, tag in enumerate(tags):
        if tag in (B_CODE, B_NUM):
            end = k
            while tag == B_CODE and end + 1 < len(tags) and tags[end + 1] == I_CODE:
                end += 1
            out.append((spans[k][0], spans[end][1], "CODE" if tag == B_CODE else "NUM"))
    return out
