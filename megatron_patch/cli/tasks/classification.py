"""--task sequence_classification: single sentences or sentence pairs -> a label; accuracy and F1."""
from __future__ import annotations

from typing import Dict

import torch

from megatron_patch.data.class_labels import encode_labels
from megatron_patch.templates.globals import get_logger

from . import metrics as M
from .base import BlackBoxFinetuner


class SequenceClassification(BlackBoxFinetuner):
    def __init__(self, engine) -> None:
        from transformers import AutoModelForSequenceClassification

        super().__init__(engine)
        self.auto_class = AutoModelForSequenceClassification
        label = self.columns["label"]
        if "test" in self.datasets and not self._labelled(self.datasets["test"][label]):
            get_logger().info("the test split has no labels (GLUE style): it is not evaluated")
            del self.datasets["test"]
        self.datasets, names = encode_labels(self.datasets, label)
        if names is None:
            raise ValueError(f"--label-column {label}: real-valued labels (regression) are not supported by "
                             "--task sequence_classification; give class labels")
        self.labels = [str(n) for n in names]
        self.label2id = {name: i for i, name in enumerate(self.labels)}

    def model_kwargs(self) -> Dict:
        return {"num_labels": len(self.labels), "id2label": dict(enumerate(self.labels)), "label2id": self.label2id}

    @staticmethod
    def _labelled(values) -> bool:
        return not all(v is None or (isinstance(v, int) and v < 0) for v in values)

    def prepare(self, split: str, dataset):
        text, label = self.columns["text"], self.columns["label"]

        def encode(batch):
            out = self.tokenizer(*[batch[c] for c in text], truncation=True, max_length=self.max_length)
            out["labels"] = batch[label]  # class ids (encode_labels)
            return out

        return dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc=f"tokenizing {split}")

    def collate_fn(self):
        from transformers import DataCollatorWithPadding

        return DataCollatorWithPadding(self.tokenizer, pad_to_multiple_of=self.args.pad_to_multiple_of)

    def metrics(self, model, loader) -> Dict[str, float]:
        predictions, labels = [], []
        for batch in loader:
            logits = model(**batch).logits
            predictions.append(self.gather(logits.argmax(-1)).cpu())
            labels.append(self.gather(batch["labels"]).cpu())
        return M.classification(torch.cat(predictions).numpy(), torch.cat(labels).numpy(), len(self.labels))
