"""--task question_answering: extractive QA in SQuAD's format (the answer is a span of the context);
exact match and token F1 (SQuAD v1 rules).

A context longer than the window is truncated (no sliding window): a training answer outside it points at
the first token, the usual "no answer" position, and such evaluation questions count as missed.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from . import metrics as M
from .base import BlackBoxFinetuner

MAX_ANSWER_TOKENS = 30


class QuestionAnswering(BlackBoxFinetuner):
    def __init__(self, engine) -> None:
        from transformers import AutoModelForQuestionAnswering

        super().__init__(engine)
        self.auto_class = AutoModelForQuestionAnswering
        self.examples: Dict[str, List] = {}  # per split: (context, offsets, reference answers) by row
        self.split_of: Dict[int, str] = {}  # prepared dataset -> its split, to find its rows when evaluating

    def prepare(self, split: str, dataset):
        q, c, a = self.columns["question"], self.columns["context"], self.columns["answers"]
        questions, contexts = list(dataset[q]), list(dataset[c])
        enc = self.tokenizer(questions, contexts, truncation="only_second", max_length=self.max_length,
                             return_offsets_mapping=True)
        starts, ends, rows = [], [], []
        for i, answers in enumerate(dataset[a]):
            sequence_ids = enc.sequence_ids(i)
            offsets = [o if s == 1 else None for o, s in zip(enc["offset_mapping"][i], sequence_ids)]
            start_char = answers["answer_start"][0] if answers["answer_start"] else None
            start = end = 0
            if start_char is not None:
                end_char = start_char + len(answers["text"][0])
                inside = [t for t, o in enumerate(offsets) if o is not None and o[0] < end_char and o[1] > start_char]
                if inside and offsets[inside[0]][0] <= start_char and offsets[inside[-1]][1] >= end_char:
                    start, end = inside[0], inside[-1]
            starts.append(start)
            ends.append(end)
            rows.append((contexts[i], offsets, list(answers["text"]) or [""]))
        self.examples[split] = rows
        features = {k: enc[k] for k in enc.keys() if k != "offset_mapping"}
        features.update(start_positions=starts, end_positions=ends, example_index=list(range(len(dataset))))
        from datasets import Dataset

        prepared = Dataset.from_dict(features)
        self.split_of[id(prepared)] = split
        return prepared

    def collate_fn(self):
        from transformers import DataCollatorWithPadding

        return DataCollatorWithPadding(self.tokenizer, pad_to_multiple_of=self.args.pad_to_multiple_of)

    def model_inputs(self, batch: Dict) -> Dict:
        return {k: v for k, v in batch.items() if k != "example_index"}

    def metrics(self, model, loader) -> Dict[str, float]:
        rows = self.examples[self.split_of[id(loader.dataset)]]
        predictions, references = [], []
        for batch in loader:
            out = model(**self.model_inputs(batch))
            starts, ends = self.gather(out.start_logits.float()).cpu(), self.gather(out.end_logits.float()).cpu()
            for idx, s_logits, e_logits in zip(self.gather(batch["example_index"]).tolist(), starts, ends):
                context, offsets, answers = rows[idx]
                predictions.append(self._best_span(context, offsets, s_logits, e_logits))
                references.append(answers)
        return M.squad(predictions, references)

    @staticmethod
    def _best_span(context: str, offsets, start_logits: torch.Tensor, end_logits: torch.Tensor) -> str:
        """The highest-scoring context span of at most MAX_ANSWER_TOKENS tokens (start <= end)."""
        n = min(len(offsets), start_logits.shape[0])
        valid = torch.tensor([offsets[t] is not None for t in range(n)])
        if not valid.any():
            return ""
        s = start_logits[:n].masked_fill(~valid, -1e9)
        e = end_logits[:n].masked_fill(~valid, -1e9)
        scores = s[:, None] + e[None, :]
        allowed = torch.ones(n, n, dtype=torch.bool).triu().tril(MAX_ANSWER_TOKENS - 1)
        best = scores.masked_fill(~allowed, -1e18).argmax().item()
        start, end = divmod(best, n)
        return context[offsets[start][0]:offsets[end][1]]
