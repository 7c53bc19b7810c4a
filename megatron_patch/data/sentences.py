"""An offline, rule-based English sentence splitter for `--split-sentences`.

Megatron-LM uses NLTK's Punkt model, which must be downloaded; this splitter needs nothing. It breaks
after `.`, `!` or `?` (with any closing quotes/brackets) when whitespace and then an upper-case letter,
digit or opening quote follow, except after common abbreviations (e.g., Dr., Fig.), single initials
(J. Smith) and dotted names (os.path). A blank line always ends a sentence. With `keep_newlines` the
newlines inside a sentence stay; otherwise each becomes a space.
"""
from __future__ import annotations

from typing import List

import regex

ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc e.g i.e cf al fig figs eq eqs no nos vol pp ed eds approx dept "
    "inc ltd co corp jan feb mar apr jun jul aug sep sept oct nov dec".split()
)
# Candidate boundary: terminator run + closing punctuation, whitespace, then a plausible sentence start.
_BOUNDARY = regex.compile(r"""([.!?]+['")\]]*)(\s+)(?=['"(\[]?[\p{Lu}\p{N}])""")
_PARAGRAPH = regex.compile(r"\n\s*\n")


def _ends_with_abbreviation(text: str) -> bool:
    word = text.rsplit(None, 1)[-1].rstrip(".").lower() if text.strip() else ""
    word = word.lstrip("(\"'[")
    return word in ABBREVIATIONS or (len(word) == 1 and word.isalpha())


def split_sentences(text: str, keep_newlines: bool = False) -> List[str]:
    """Sentences of `text` in order; no text is dropped except the whitespace between sentences."""
    out: List[str] = []
    for para in _PARAGRAPH.split(text):
        start = 0
        for m in _BOUNDARY.finditer(para):
            head = para[start : m.end(1)]
            if m.group(1) == "." and _ends_with_abbreviation(head):
                continue
            out.append(head)
            start = m.end(2)
        out.append(para[start:])
    cleaned = [s.strip() if keep_newlines else s.replace("\n", " ").strip() for s in out]
    return [s for s in cleaned if s]
