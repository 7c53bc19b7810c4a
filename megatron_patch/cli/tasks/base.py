"""The black-box fine-tuning tasks are Finetuner subclasses: the dataset comes from --data-path (offline),
the model from --pretrained-model-name-or-path with the task's AutoModelFor... class, batches are padded to
their longest sample, and each task computes its usual metric."""
from __future__ import annotations

import sys
from typing import Dict, List

import torch

from megatron_patch.data.finetune_data import load_finetune_dataset
from megatron_patch.data.task_columns import find_task_columns
from megatron_patch.templates.finetuner import Finetuner
from megatron_patch.templates.globals import get_logger

MAX_LENGTH_CAP = 512


class BlackBoxFinetuner(Finetuner):
    """Shared steps of the black-box tasks; subclasses set `auto_class` and implement `prepare` and `metrics`."""

    auto_class = None
    eval_collate_fn = None  # set when evaluation batches need other collation than training (masked LM)

    def __init__(self, engine) -> None:
        super().__init__(engine)
        from transformers import AutoTokenizer

        args = self.args
        if not sys.stderr.isatty():  # no progress bars of `datasets` in log files
            import datasets

            datasets.disable_progress_bars()
        self.tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path)
        self.max_length = args.seq_length or min(self.tokenizer.model_max_length or MAX_LENGTH_CAP, MAX_LENGTH_CAP)
        self.datasets = load_finetune_dataset(args.data_path, args.data_name, args.data_dir)
        self.columns = find_task_columns(args.task, self.datasets, args.text_columns, args.label_column)
        get_logger().info(f"data: {', '.join(f'{k} {len(v)}' for k, v in self.datasets.items())} samples from "
                          f"{args.data_path}; columns {self.columns}")

    # subclasses ---------------------------------------------------------------------------------------------
    def prepare(self, split: str, dataset):
        """Tokenize one split; returns the dataset of model inputs."""
        raise NotImplementedError

    def collate_fn(self):
        raise NotImplementedError

    def model_kwargs(self) -> Dict:
        return {}

    def metrics(self, model: torch.nn.Module, loader) -> Dict[str, float]:
        raise NotImplementedError

    # the Finetuner hooks --------------------------------------------------------------------------------------
    def train_valid_test_datasets_provider(self):
        out = []
        for split in ("train", "validation", "test"):
            ds = self.datasets.get(split)
            out.append(self.prepare(split, ds) if ds is not None else None)
        if out[1] is None:
            raise ValueError(f"--data-path {self.args.data_path}: no labelled validation split to evaluate on")
        return out[0], out[1], out[2], self.collate_fn()

    def model_optimizer_lr_scheduler_provider(self):
        from transformers import AutoConfig

        from megatron_patch.templates.rules.shape_flags import config_settings

        # --hidden-dropout, --attention-dropout, --init-method-std go into the config the model is built from
        # (the init std reaches the weights the directory does not hold, e.g. a new classification head)
        settings = config_settings(self.args, AutoConfig.from_pretrained(self.args.load))
        if settings:
            get_logger().info("model config: " + ", ".join(f"{k} {v}" for k, v in settings.items())
                              + " (--hidden-dropout, --attention-dropout, --init-method-std)")
        model = self.auto_class.from_pretrained(self.args.load, **self.model_kwargs(), **settings)
        return model, None, None

    def model_inputs(self, batch: Dict) -> Dict:
        return batch

    def run_forward_step(self, batch, model):
        return model(**self.model_inputs(batch)).loss

    def run_compute_metrics(self, model: List[torch.nn.Module], eval_dataloader) -> Dict[str, float]:
        return self.metrics(model[0], eval_dataloader)

    def after_training(self, model, test_ds, collate_fn, reporter, epoch: int, step: int) -> None:
        if test_ds is not None:
            loader = self.build_data_loader(test_ds, collate_fn=self.eval_collate_fn or collate_fn)
            reporter.evaluation(epoch, step, "test", self.evaluate(loader, model))

    # helpers ------------------------------------------------------------------------------------------------
    def token_weighted_loss(self, model, loader, shift: bool) -> Dict[str, float]:
        """Loss averaged over every predicted token of the split (all workers, the sampler's repeats left out),
        and its perplexity. `shift`: causal models predict token t+1 from position t."""
        sums, counts = [], []
        for batch in loader:
            logits = model(**self.model_inputs(batch)).logits.float()
            labels = batch["labels"]
            if shift:
                logits, labels = logits[:, :-1], labels[:, 1:]
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100,
                                                     reduction="none")
            per_sample = torch.stack([loss.sum(1).double(), (labels != -100).sum(1).double()], dim=1)
            gathered = self.gather(per_sample)
            sums.append(gathered[:, 0].sum())
            counts.append(gathered[:, 1].sum())
        total, n = torch.stack(sums).sum().item(), torch.stack(counts).sum().item()
        mean = total / n if n else float("nan")
        return {"loss": mean, "perplexity": float(torch.exp(torch.tensor(mean)))}
