"""--task masked_lm and --task causal_lm (the guide's `casual_lm`): text -> the model's own objective;
the metric is the token-weighted loss and its perplexity."""
from __future__ import annotations

from typing import Dict

import numpy as np

from .base import BlackBoxFinetuner


class _LanguageModeling(BlackBoxFinetuner):
    def __init__(self, engine) -> None:
        super().__init__(engine)
        if self.tokenizer.pad_token is None:  # GPT-2 style tokenizers have none; padding is masked out anyway
            self.tokenizer.pad_token = self.tokenizer.eos_token

    def _encode(self, split: str, dataset):
        text = self.columns["text"]
        # token types are a BERT input; a GPT-2 would add them as embeddings of the word table
        types = isinstance(self, MaskedLM)
        return dataset.map(lambda b: self.tokenizer(b[text], truncation=True, max_length=self.max_length,
                                                    return_token_type_ids=types),
                           batched=True, remove_columns=dataset.column_names, desc=f"tokenizing {split}")


class MaskedLM(_LanguageModeling):
    """Training masks --mask-prob of the tokens afresh every batch (BERT's 80/10/10 rule); validation and test
    mask a fixed set of positions (seeded per sample), so every evaluation scores the same problem."""

    def __init__(self, engine) -> None:
        from transformers import AutoModelForMaskedLM, DataCollatorForTokenClassification

        super().__init__(engine)
        self.auto_class = AutoModelForMaskedLM
        if self.tokenizer.mask_token_id is None:
            raise ValueError(f"--task masked_lm: the tokenizer of {self.args.pretrained_model_name_or_path} has no "
                             "mask token")
        self.eval_collate_fn = DataCollatorForTokenClassification(self.tokenizer,
                                                                  pad_to_multiple_of=self.args.pad_to_multiple_of)

    def prepare(self, split: str, dataset):
        encoded = self._encode(split, dataset)
        if split == "train":
            return encoded
        special = set(self.tokenizer.all_special_ids)
        mask_id, prob, seed = self.tokenizer.mask_token_id, self.args.mask_prob, self.args.seed

        def mask(sample, idx):
            rng = np.random.default_rng([seed, idx])
            ids = list(sample["input_ids"])
            labels = [-100] * len(ids)
            candidates = [i for i, t in enumerate(ids) if t not in special]
            chosen = [i for i in candidates if rng.random() < prob] or candidates[:1]
            for i in chosen:
                labels[i], ids[i] = ids[i], mask_id
            return {"input_ids": ids, "labels": labels}

        return encoded.map(mask, with_indices=True, desc=f"masking {split}")

    def collate_fn(self):
        from transformers import DataCollatorForLanguageModeling

        return DataCollatorForLanguageModeling(self.tokenizer, mlm=True, mlm_probability=self.args.mask_prob,
                                               pad_to_multiple_of=self.args.pad_to_multiple_of)

    def metrics(self, model, loader) -> Dict[str, float]:
        return self.token_weighted_loss(model, loader, shift=False)


class CausalLM(_LanguageModeling):
    def __init__(self, engine) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__(engine)
        self.auto_class = AutoModelForCausalLM

    def prepare(self, split: str, dataset):
        return self._encode(split, dataset)

    def collate_fn(self):
        from transformers import DataCollatorForLanguageModeling

        return DataCollatorForLanguageModeling(self.tokenizer, mlm=False,
                                               pad_to_multiple_of=self.args.pad_to_multiple_of)

    def metrics(self, model, loader) -> Dict[str, float]:
        return self.token_weighted_loss(model, loader, shift=True)
