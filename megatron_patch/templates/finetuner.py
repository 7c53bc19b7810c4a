"""The Finetuner template: subclass it, implement four methods, and `train()` does the rest.

Hooks (the how-to's white-box section):
- `train_valid_test_datasets_provider()` -> train, valid, test datasets and a collate_fn (or None);
- `model_optimizer_lr_scheduler_provider()` -> model, optimizer or None, lr scheduler or None;
- `run_forward_step(batch, model)` -> the loss of one batch;
- `run_compute_metrics(model, eval_dataloader)` -> a dict of metrics; `model` is a list (one entry), as in
  the document.
`train()` applies the acceleration switches, runs the epochs (or --train-iters steps) with gradient
accumulation on the torch loop (`torch_loop.py`: epochs are its stop rule), evaluates after every epoch (and every
--eval-interval steps when that flag is given), reports, and saves with `save_pretrained` to --save. Flags a fine-tuning run does not use are refused (config/flag_use.py).
With --padding-free the training batches the collate function pads are packed into one row each (data/flatten.py)
and the model takes them (accelerations/padding_free.py); evaluation batches stay padded.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .data import DeviceLoader, GatherState, build_loader, gather
from .engine import RapidformerEngine
from .globals import get_logger
from .reporting import LoopReporter
from .saving import save_pretrained
from .schedule import build_scheduler
from .rules.shape_flags import check_shape_flags
from .torch_loop import (EpochBatches, Stop, TorchLoop, TrainState, TrainStep, Validator, accelerate_for_loop,
                         evaluating)


class Finetuner:
    """Base class of white-box fine-tuning scripts; the black-box tasks are subclasses too."""

    def __init__(self, engine: RapidformerEngine) -> None:
        self.engine = engine
        self.args = engine.args
        self.device = engine.device
        self.tokenizer = None  # set by subclasses that have one; the default collate pads with it
        self._gather_state = GatherState()
        self.model: Optional[torch.nn.Module] = None

    # ---- the four hooks ---------------------------------------------------------------------------------
    def train_valid_test_datasets_provider(self) -> Tuple[Any, Any, Any, Optional[Callable]]:
        raise NotImplementedError("implement train_valid_test_datasets_provider() -> train, valid, test, collate_fn")

    def model_optimizer_lr_scheduler_provider(self) -> Tuple[torch.nn.Module, Any, Any]:
        raise NotImplementedError("implement model_optimizer_lr_scheduler_provider() -> model, optimizer or None, "
                                  "lr_scheduler or None")

    def run_forward_step(self, batch: Any, model: torch.nn.Module) -> torch.Tensor:
        raise NotImplementedError("implement run_forward_step(batch, model) -> loss")

    def run_compute_metrics(self, model: List[torch.nn.Module], eval_dataloader) -> Dict[str, float]:
        raise NotImplementedError("implement run_compute_metrics(model, eval_dataloader) -> dict of metrics")

    # ---- services for the hooks and for users' own loops ---------------------------------------------------
    def build_data_loader(self, dataset, batch_size: Optional[int] = None, shuffle: bool = False,
                          collate_fn: Optional[Callable] = None, drop_last: bool = False) -> DeviceLoader:
        """A DataLoader over this worker's share of `dataset` (data parallel), whose batches arrive on the
        device. Without `collate_fn` it pads each batch to its longest sample with the model's tokenizer
        (--pretrained-model-name-or-path)."""
        if collate_fn is None:
            collate_fn = self._default_collate()
        return build_loader(dataset, batch_size or self.args.micro_batch_size, shuffle, collate_fn, self.args.seed,
                            self.device, self._gather_state, self.args.num_workers, drop_last)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every worker's `tensor` for the current evaluation batch, in dataset order (padding repeats dropped)."""
        return gather(tensor, self._gather_state)

    def _default_collate(self) -> Callable:
        from transformers import AutoTokenizer, DataCollatorWithPadding

        if self.tokenizer is None:
            if not self.args.pretrained_model_name_or_path:
                raise ValueError("build_data_loader() without a collate_fn pads with the model's tokenizer: give "
                                 "--pretrained-model-name-or-path, or pass collate_fn")
            self.tokenizer = AutoTokenizer.from_pretrained(self.args.pretrained_model_name_or_path)
        return DataCollatorWithPadding(self.tokenizer, pad_to_multiple_of=self.args.pad_to_multiple_of)

    def _packing(self, collate_fn: Optional[Callable], model: torch.nn.Module) -> Callable:
        """--padding-free: training batches as one packed row each (data/flatten.py), from the batches `collate_fn`
        (or the default collate) pads; evaluation keeps the padded batches."""
        from megatron_patch.data.flatten import FlattenCollator

        inner = getattr(model, "module", model)  # DDP's wrapped module; FSDP2 and torch.compile keep the model
        config = getattr(inner, "config", None)
        positions = getattr(config, "max_position_embeddings", None)
        if positions is None:
            raise ValueError("--padding-free: the model has no config.max_position_embeddings (a Hugging Face "
                             "encoder's), which bounds each sample's length; drop --padding-free")
        multiple = getattr(self.args, "packed_row_multiple", None) or self.args.pad_to_multiple_of or 64
        return FlattenCollator(collate_fn or self._default_collate(), multiple, positions)

    # ---- the loop ---------------------------------------------------------------------------------------
    def _accelerate(self):
        model, optimizer, scheduler = self.model_optimizer_lr_scheduler_provider()
        check_shape_flags(self.args, model, "model_optimizer_lr_scheduler_provider()")
        return accelerate_for_loop(model, optimizer, scheduler, self.args, self.device, get_logger())

    def evaluate(self, loader, model: torch.nn.Module) -> Dict[str, float]:
        from megatron_patch.accelerations import uses_cuda_graphs

        with evaluating(model, self.precision, uses_cuda_graphs(self.args)):
            return self.run_compute_metrics([model], loader)

    def train(self) -> Dict[str, float]:
        """Fine-tune: epochs of --micro-batch-size batches per worker (or --train-iters optimizer steps, with
        gradient accumulation up to --global-batch-size), an evaluation after every epoch, the model saved to
        --save. Returns the last validation metrics. The loop is the torch loop (templates/torch_loop.py)."""
        from megatron_patch.accelerations import mark_step, uses_cuda_graphs

        from megatron_patch.config.rapidformer_flags import given_flags
        from megatron_patch.config.flag_use import refuse_unused
        from megatron_patch.config import ConfigError

        args, log = self.args, get_logger()
        refuse_unused(args, ("finetuner",) if args.user_script else ("ft",), error=ConfigError)
        # --eval-interval N (when given; its default is pretraining's): also evaluate every N optimizer steps
        every = args.eval_interval if "eval_interval" in given_flags(args) else 0
        train_ds, valid_ds, test_ds, collate_fn = self.train_valid_test_datasets_provider()
        acc, scheduler = self._accelerate()
        model, optimizer, self.precision = acc.model, acc.optimizer, acc.precision
        self.engine.precision = acc.precision
        self.model = model
        train_collate = self._packing(collate_fn, model) if getattr(args, "padding_free", False) else collate_fn
        train_loader = self.build_data_loader(train_ds, shuffle=True, collate_fn=train_collate, drop_last=False)
        eval_collate = getattr(self, "eval_collate_fn", None) or collate_fn
        valid_loader = self.build_data_loader(valid_ds, collate_fn=eval_collate) if valid_ds is not None else None
        data = EpochBatches(train_loader, args.grad_accumulation, self.engine.world_size)
        steps_per_epoch = data.steps_per_epoch
        epochs = args.epochs or math.ceil(args.train_iters / steps_per_epoch)
        total = min(args.train_iters or epochs * steps_per_epoch, epochs * steps_per_epoch)
        if scheduler is None:
            scheduler = build_scheduler(args, optimizer, total)
        log.info(f"training: {len(train_ds)} samples; {training_span(args.train_iters, epochs, steps_per_epoch)}; "
                 f"each step {args.global_batch_size} samples ({args.micro_batch_size} per worker x "
                 f"{self.engine.world_size} worker(s) x {args.grad_accumulation} accumulation)")
        reporter = LoopReporter(args, self.engine.rank, total, "step", epochs)

        def evaluate(progress: TrainState, when: str) -> Dict[str, float]:
            metrics = self.evaluate(valid_loader, model)
            epoch, step = (0, 0) if when == "start" else (progress.epoch, progress.iteration)
            reporter.evaluation(epoch, step, "validation", metrics, in_epoch=when == "step")
            return metrics

        has_valid = valid_loader is not None
        validator = Validator(evaluate, every=every if has_valid else 0, at_start=args.eval_at_start and has_valid,
                              each_epoch=has_valid)
        step = TrainStep(model, optimizer, scheduler, self.precision, self.run_forward_step, args.clip_grad,
                         mark_step if uses_cuda_graphs(args) else None)
        # epochs are a stop rule; --train-iters (when given) another, whichever comes first
        loop = TorchLoop(model, step, data, Stop(steps=args.train_iters, epochs=epochs), validator, reporter)
        progress = loop.train(TrainState())
        self.after_training(model, test_ds, collate_fn, reporter, progress.epoch, progress.iteration)
        reporter.close()
        if args.save:
            save_pretrained(model, args.save, self.tokenizer)
            what = "the LoRA adapter (PEFT's adapter_config.json, adapter_model.safetensors)" \
                if getattr(args, "lora_rank", 0) else "the model"
            log.info(f"saved {what}{' and tokenizer' if self.tokenizer is not None else ''} to {args.save} "
                     "(save_pretrained)")
        return validator.last

    def after_training(self, model, test_ds, collate_fn, reporter, epoch: int, step: int) -> None:
        """Called once training ends, before saving; the black-box tasks evaluate a labelled test split here."""


def training_span(train_iters: Optional[int], epochs: int, steps_per_epoch: int) -> str:
    """How long a fine-tuning run is, in its own unit: optimizer steps when --train-iters ends it (the loop may stop
    inside an epoch: a fraction), else whole epochs."""
    if train_iters is not None and train_iters <= epochs * steps_per_epoch:
        return (f"{train_iters} optimizer steps (--train-iters {train_iters}) = {train_iters / steps_per_epoch:.3g} "
                f"epoch(s) of {steps_per_epoch} steps")
    return f"{epochs} epoch(s) of {steps_per_epoch} steps = {epochs * steps_per_epoch} optimizer steps"
