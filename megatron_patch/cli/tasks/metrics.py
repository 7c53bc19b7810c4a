"""The usual fine-tuning metrics, computed locally (no metric scripts from the hub)."""
from __future__ import annotations

import collections
import re
import string
from typing import Dict, List, Sequence

import numpy as np


def classification(predictions: np.ndarray, labels: np.ndarray, num_labels: int) -> Dict[str, float]:
    """Accuracy and F1 (binary F1 of class 1 for two classes, macro F1 otherwise)."""
    from sklearn.metrics import accuracy_score, f1_score

    average = "binary" if num_labels == 2 else "macro"
    return {"accuracy": float(accuracy_score(labels, predictions)),
            "f1": float(f1_score(labels, predictions, average=average, zero_division=0))}


def _spans(tags: Sequence[str]) -> set:
    """(type, start, end) of each entity in a BIO sequence (an I- without its B- starts an entity, as conlleval)."""
    spans, start, kind = set(), None, None
    for i, tag in enumerate(list(tags) + ["O"]):
        prefix, _, name = tag.partition("-")
        if start is not None and (prefix in ("O", "B") or name != kind):
            spans.add((kind, start, i))
            start = None
        if prefix == "B" or (prefix == "I" and start is None):
            start, kind = i, name
    return spans


def entity_f1(predicted: List[List[str]], gold: List[List[str]]) -> Dict[str, float]:
    """Entity-level precision, recall and F1 (an entity counts when its type and both ends match), and tag accuracy."""
    tp = n_pred = n_gold = 0
    correct = total = 0
    for p, g in zip(predicted, gold):
        ps, gs = _spans(p), _spans(g)
        tp += len(ps & gs)
        n_pred += len(ps)
        n_gold += len(gs)
        correct += sum(a == b for a, b in zip(p, g))
        total += len(g)
    precision = tp / n_pred if n_pred else 0.0
    recall = tp / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "accuracy": correct / total if total else 0.0}


def _normalize(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _token_f1(prediction: str, reference: str) -> float:
    p, r = _normalize(prediction).split(), _normalize(reference).split()
    common = collections.Counter(p) & collections.Counter(r)
    same = sum(common.values())
    if not p or not r:
        return float(p == r)
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(r)
    return 2 * precision * recall / (precision + recall)


def squad(predictions: List[str], references: List[List[str]]) -> Dict[str, float]:
    """Exact match and token F1 against the best of each question's reference answers (SQuAD v1)."""
    em = [max(float(_normalize(p) == _normalize(r)) for r in refs) for p, refs in zip(predictions, references)]
    f1 = [max(_token_f1(p, r) for r in refs) for p, refs in zip(predictions, references)]
    return {"exact_match": float(np.mean(em)) if em else 0.0, "f1": float(np.mean(f1)) if f1 else 0.0}


def overlap(predictions: List[str], references: List[str]) -> float:
    """Mean unigram-overlap F1 of generated and reference texts (a ROUGE-1-like score)."""
    scores = [_token_f1(p, r) for p, r in zip(predictions, references)]
    return float(np.mean(scores)) if scores else 0.0
