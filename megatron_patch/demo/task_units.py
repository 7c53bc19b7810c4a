"""The material of one row ("unit") of each task's demo corpus, cut from one stdlib docstring (task_corpora).

sequence_classification: pairs of consecutive prose sentences; token_classification: a sentence's tokens and
tags; question_answering: a context of one to three sentences with a question about an identifier or a number
in it; masked/causal LM: the docstring's paragraphs cut at LM_MAX_WORDS; seq2seq_lm: a paragraph and its first
HEADLINE_WORDS words. A sentence already used anywhere in the corpus (`seen`) is not used again.
"""
from __future__ import annotations

import random
import re

from megatron_patch.data.sentences import split_sentences
from megatron_patch.demo.task_tags import LEAD, TRAIL, entity_spans, tag_tokens, word_spans

LM_TASKS = ("masked_lm", "casual_lm", "causal_lm")
QUESTIONS = ("Which identifier is mentioned first?", "Which identifier is mentioned last?",
             "Which number is mentioned first?")
LM_MAX_WORDS = 200
HEADLINE_WORDS = 8


def _clean(text: str) -> str:
    return " ".join(text.split())


def _is_sentence(s: str, lo: int, hi: int, min_alpha: float, capital: bool = True) -> bool:
    """A prose sentence of lo..hi words: not a doctest, mostly words (share >= min_alpha), starting with a
    capital letter or a quote unless `capital` is False (sentences may open with an identifier)."""
    words = s.split()
    if not lo <= len(words) <= hi or ">>>" in s or "::" in s:
        return False
    if capital and not (s[0].isupper() or s[0] in "`'\""):
        return False
    alpha = sum(w.strip(LEAD + TRAIL + ")]}").isalpha() for w in words)
    return alpha >= min_alpha * len(words)


# ------------------------------------------------------------------------------ units for each task
# A "unit" is the material of one row; the rows are built once the splits are chosen.


def _sentence_slots(doc: str, seen: set[str]) -> list[str | None]:
    """The docstring's sentences in order; a sentence already used anywhere becomes None (gap kept, so
    "consecutive" stays literal)."""
    slots: list[str | None] = []
    for s in split_sentences(doc):
        s = _clean(s)
        slots.append(None if s in seen else s)
        seen.add(s)
    return slots


def doc_units(task: str, source: str, doc: str, seen: set[str], rng: random.Random) -> tuple[list, list[str]]:
    """(units, sentences usable as a negative sentence2) from one docstring."""
    if task in LM_TASKS or task == "seq2seq_lm":
        return _paragraph_units(task, doc, seen), []
    slots = _sentence_slots(doc, seen)
    units: list = []
    if task == "sequence_classification":
        ok = [s is not None and _is_sentence(s, 6, 40, 0.6) for s in slots]
        units = [(slots[i], slots[i + 1]) for i in range(len(slots) - 1) if ok[i] and ok[i + 1]]
        return units, [s for s, good in zip(slots, ok) if good]
    if task == "token_classification":
        for s in slots:
            if s is not None and _is_sentence(s, 5, 40, 0.4, capital=False):
                tokens = [s[a:b] for a, b in word_spans(s)]
                tags = tag_tokens(tokens)
                if len(tokens) <= 60:
                    units.append((tokens, tags))
        return units, []
    # question_answering: a sentence holding an identifier or a number, maybe with an entity-free
    # sentence before it (so answers are not always at the start) and the sentence after it; up to
    # three questions per context, as SQuAD asks several questions about one paragraph.
    for i, s in enumerate(slots):
        if s is None or not _is_sentence(s, 4, 40, 0.3, capital=False) or not entity_spans(s):
            continue
        parts = [s]
        prev = slots[i - 1] if i > 0 else None
        if prev is not None and _is_sentence(prev, 3, 40, 0.5) and not entity_spans(prev) and rng.random() < 0.5:
            parts.insert(0, prev)
        nxt = slots[i + 1] if i + 1 < len(slots) else None
        if nxt is not None and _is_sentence(nxt, 3, 40, 0.4) and rng.random() < 0.5:
            parts.append(nxt)
        context = " ".join(parts)
        spans = entity_spans(context)
        code = [(a, b) for a, b, kind in spans if kind == "CODE"]
        nums = [(a, b) for a, b, kind in spans if kind == "NUM"]
        if code:
            units.append((source, context, QUESTIONS[0], *code[0]))
            if context[slice(*code[-1])] != context[slice(*code[0])]:
                units.append((source, context, QUESTIONS[1], *code[-1]))
        if nums:
            units.append((source, context, QUESTIONS[2], *nums[0]))
    return units, []


def _paragraph_units(task: str, doc: str, seen: set[str]) -> list:
    paragraphs = []
    for para in re.split(r"\n\s*\n", doc):
        para = _clean(para)
        sentences = split_sentences(para)
        # Doctests and paragraphs sharing a sentence with text already used (inherited docstrings) go.
        if len(para.split()) < 8 or ">>>" in para or any(s in seen for s in sentences):
            continue
        seen.update(sentences)
        paragraphs.append(para)
    if task == "seq2seq_lm":
        units = []
        for para in paragraphs:
            words = para.split()
            if len(words) >= 12:
                units.append((" ".join(words[:64]), " ".join(words[:HEADLINE_WORDS])))
        return units
    out, budget = [], LM_MAX_WORDS
    for para in paragraphs:
        words = para.split()
        out.append(" ".join(words[:budget]))
        budget -= min(budget, len(words))
        if budget == 0:
            break
    text = "\n\n".join(out)
    return [text] if len(text.split()) >= 8 else []
