"""--task seq2seq_lm: source text -> target text with an encoder-decoder model; the metrics are the
token-weighted loss and the unigram-overlap F1 of greedy generations against the references."""
from __future__ import annotations

from typing import Dict


from . import metrics as M
from .base import BlackBoxFinetuner
from megatron_patch.templates.saving import unwrap

MAX_TARGET_LENGTH = 64


class Seq2SeqLM(BlackBoxFinetuner):
    def __init__(self, engine) -> None:
        from transformers import AutoModelForSeq2SeqLM

        super().__init__(engine)
        self.auto_class = AutoModelForSeq2SeqLM
        self.references: Dict[int, list] = {}
        # generation length per prepared split (by id, as the loader's dataset): its longest target, capped
        self.new_tokens: Dict[int, int] = {}

    def prepare(self, split: str, dataset):
        source, target = self.columns["source"], self.columns["target"]

        def encode(batch):
            return self.tokenizer(batch[source], text_target=batch[target], truncation=True,
                                  max_length=self.max_length, return_token_type_ids=False)

        prepared = dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc=f"tokenizing {split}")
        lengths = [len(x) for x in prepared["labels"]]
        self.new_tokens[id(prepared)] = min(MAX_TARGET_LENGTH, max(lengths) if lengths else 1)
        return prepared

    def collate_fn(self):
        from transformers import DataCollatorForSeq2Seq

        return DataCollatorForSeq2Seq(self.tokenizer, pad_to_multiple_of=self.args.pad_to_multiple_of)

    def metrics(self, model, loader) -> Dict[str, float]:
        out = self.token_weighted_loss(model, loader, shift=False)
        generator = unwrap(model)
        new_tokens = self.new_tokens.get(id(loader.dataset), MAX_TARGET_LENGTH)
        predictions, references = [], []
        for batch in loader:
            # every worker generates the same number of tokens: FSDP's collectives run in step
            generated = generator.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                           max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                           do_sample=False, num_beams=1)
            predictions += [self._text(row[1:]) for row in self.gather(generated).tolist()]  # [0]: decoder start
            references += [self._text(row) for row in self.gather(batch["labels"]).tolist()]
        out["overlap_f1"] = M.overlap(predictions, references)
        return out

    def _text(self, ids) -> str:
        """Decoded up to the first end of sequence (generation was made to run on past it), without padding."""
        eos = self.tokenizer.eos_token_id
        kept = []
        for t in ids:
            if t == eos:
                break
            if t >= 0 and t != self.tokenizer.pad_token_id:
                kept.append(t)
        return self.tokenizer.decode(kept, skip_special_tokens=True)
