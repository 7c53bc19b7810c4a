"""--task token_classification: a tag per word (BIO entities); entity-level F1 and tag accuracy."""
from __future__ import annotations

from typing import Dict


from megatron_patch.data.class_labels import encode_labels

from . import metrics as M
from .base import BlackBoxFinetuner


class TokenClassification(BlackBoxFinetuner):
    def __init__(self, engine) -> None:
        from transformers import AutoModelForTokenClassification

        super().__init__(engine)
        self.auto_class = AutoModelForTokenClassification
        self.datasets, names = encode_labels(self.datasets, self.columns["tags"])
        self.labels = [str(n) for n in names]
        self.label2id = {n: i for i, n in enumerate(self.labels)}
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError(f"--task token_classification needs a fast tokenizer (word ids) for "
                             f"{self.args.pretrained_model_name_or_path}")

    def model_kwargs(self) -> Dict:
        return {"num_labels": len(self.labels), "id2label": dict(enumerate(self.labels)), "label2id": self.label2id}

    def prepare(self, split: str, dataset):
        words, tags = self.columns["tokens"], self.columns["tags"]

        def encode(batch):
            out = self.tokenizer(batch[words], is_split_into_words=True, truncation=True, max_length=self.max_length)
            out["labels"] = []
            for i, sample_tags in enumerate(batch[tags]):
                previous, row = None, []
                for w in out.word_ids(i):
                    # the first piece of each word carries its tag; other pieces and special tokens are ignored
                    row.append(-100 if w is None or w == previous else sample_tags[w])
                    previous = w
                out["labels"].append(row)
            return out

        return dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc=f"tokenizing {split}")

    def collate_fn(self):
        from transformers import DataCollatorForTokenClassification

        return DataCollatorForTokenClassification(self.tokenizer, pad_to_multiple_of=self.args.pad_to_multiple_of)

    def metrics(self, model, loader) -> Dict[str, float]:
        predicted, gold = [], []
        for batch in loader:
            logits = model(**batch).logits
            pred, lab = self.gather(logits.argmax(-1)).cpu(), self.gather(batch["labels"]).cpu()
            for p, g in zip(pred.tolist(), lab.tolist()):
                keep = [(a, b) for a, b in zip(p, g) if b != -100]
                predicted.append([self.labels[a] if 0 <= a < len(self.labels) else "O" for a, _ in keep])
                gold.append([self.labels[b] for _, b in keep])
        return M.entity_f1(predicted, gold)
