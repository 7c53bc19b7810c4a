"""The how-to's white-box Finetuner sample ("Caixa branca: Ajuste fino com Hugging Face usando o template
Finetuner"), with only the changes needed to run here, each marked `# changed:` (listed in the README):

    rapidformer --user-script examples/rapidformer_finetune_huggingface_bert_trainer.py \
        --task sequence_classification --pretrained-model-name-or-path $MODEL --data-path $DATA ...
"""
import numpy as np
import torch  # changed: the sample uses torch without importing it
from transformers import AutoConfig, AutoTokenizer, BertForSequenceClassification  # changed: `transformers.easytexmier` typo; AutoTokenizer was not imported

from megatron_patch.data.finetune_data import load_finetune_dataset  # changed: offline local data instead of datasets.load_dataset from the hub
from rapidformer import RapidformerEngine
from rapidformer import get_args
from rapidformer import get_logger
from rapidformer import get_timers
from rapidformer import Finetuner
from rapidformer import Pretrainer
from rapidformer import build_train_valid_test_datasets_for_huggingface


class LocalAccuracyF1:
    """changed: stands in for `datasets.load_metric("glue", "mrpc")` (removed from datasets; it also downloads
    a script): the same add_batch()/compute() calls, computed locally."""

    def __init__(self):
        self.predictions, self.references = [], []

    def add_batch(self, predictions, references):
        self.predictions.append(predictions.cpu().numpy())
        self.references.append(references.cpu().numpy())

    def compute(self):
        from sklearn.metrics import accuracy_score, f1_score

        p, r = np.concatenate(self.predictions), np.concatenate(self.references)
        return {"accuracy": float(accuracy_score(r, p)), "f1": float(f1_score(r, p))}


class MyFintuner(Finetuner):
    def __init__(self, engine):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self):
        args = get_args()  # changed: the sample reads `args` here without getting it
        tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path)  # changed: was the hub name "bert-base-cased"

        def tokenize_function(examples):
            # max_length=None uses the model's maximum length
            outputs = tokenizer(examples["sentence1"], examples["sentence2"], truncation=True, max_length=None)
            return outputs

        datasets = load_finetune_dataset(args.dataset_path, args.dataset_name)  # changed: see the import
        tokenized_datasets = datasets.map(
            tokenize_function,
            batched=True,
            remove_columns=["idx", "sentence1", "sentence2"],
        )
        tokenized_datasets = tokenized_datasets.rename_column("label", "labels")  # changed: rename_column_ no longer exists

        train_dataset = tokenized_datasets["train"]
        valid_dataset = tokenized_datasets['validation']
        test_dataset = tokenized_datasets['test']

        def collate_fn(examples):
            return tokenizer.pad(examples, padding="longest", return_tensors="pt")

        return train_dataset, valid_dataset, test_dataset, collate_fn

    def model_optimizer_lr_scheduler_provider(self):
        args = get_args()
        model = BertForSequenceClassification.from_pretrained(args.load)
        return model, None, None

    def run_forward_step(self, batch, model):
        output_tensor = model(**batch)
        return output_tensor.loss

    def run_compute_metrics(self, model, eval_dataloader):
        model = model[0]
        metric = LocalAccuracyF1()  # changed: was load_metric(args.dataset_path, args.dataset_name)
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            metric.add_batch(
                predictions=self.gather(predictions),
                references=self.gather(batch["labels"]),
            )
        eval_metric = metric.compute()
        return eval_metric


engine = RapidformerEngine()
trainer = MyFintuner(engine=engine)
trainer.train()
