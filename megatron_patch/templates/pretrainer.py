"""The PreTrainer template: pretraining from an iterator of batches, for Hugging Face and Megatron models.

Hooks (the how-to's pretraining sections):
- `train_valid_test_datasets_provider(train_val_test_num_samples)` -> train, valid, test datasets;
- `model_optimizer_lr_scheduler_provider()` -> model, optimizer or None, lr scheduler or None;
- `run_forward_step(data_iterator, model)` -> the loss of one micro batch.
`train()` starts the process groups and seeds (as the engine does), calls the hooks in the engine's order
(datasets, then model), and trains for --train-iters iterations of --global-batch-size samples:
- a megatron-core model (e.g. `megatron_patch.models.GPTModel()`) runs on the engine: TP/PP/VPP schedules,
  ZeRO-1/2, mixed precision, recompute, distributed checkpoints (`pretrain_megatron.py`);
- any other torch.nn.Module is a Hugging Face/PyTorch model: data parallel with the fine-tuning
  accelerations (`pretrain_hf.py`).
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import torch

from .engine import RapidformerEngine
from .globals import get_logger
from .pretraining_data import build_train_valid_test_datasets_for_huggingface  # noqa: F401  (re-exported)


class PreTrainer:
    """Base class of white-box pretraining scripts (and of the black-box `--task pretraining`)."""

    def __init__(self, engine: RapidformerEngine) -> None:
        self.engine = engine
        self.args = engine.args
        self.device = engine.device
        self.trainer = None  # the engine's Trainer, for a Megatron model

    # ---- the three hooks -------------------------------------------------------------------------------------
    def train_valid_test_datasets_provider(self, train_val_test_num_samples: Sequence[int]) -> Tuple[Any, Any, Any]:
        raise NotImplementedError("implement train_valid_test_datasets_provider(train_val_test_num_samples) -> "
                                  "train, valid, test datasets")

    def model_optimizer_lr_scheduler_provider(self) -> Tuple[Any, Any, Any]:
        raise NotImplementedError("implement model_optimizer_lr_scheduler_provider() -> model, optimizer or None, "
                                  "lr_scheduler or None")

    def run_forward_step(self, data_iterator, model) -> torch.Tensor:
        raise NotImplementedError("implement run_forward_step(data_iterator, model) -> loss")

    # ---- the loop --------------------------------------------------------------------------------------------
    def train(self) -> List[dict]:
        """Pretrain for --train-iters iterations; returns one dict of metrics per iteration."""
        from megatron_patch.config import ConfigError
        from megatron_patch.config.flag_use import refuse_unused
        from megatron_patch.models.run_context import model_run
        from megatron_patch.parallel import initialize
        from megatron_patch.training.data import sample_counts

        from .rules import pretrainer as _rules  # noqa: F401  (registers the rules of a PreTrainer)
        from . import pretrain_megatron
        from .rules.table import run_front

        args, log = self.args, get_logger()
        run_front(args, self.engine.world_size, lambda concern: concern == "pretrainer", ConfigError)
        # flags no pretraining run reads (--epochs, --eval-at-start ...); the rest once the model says its kind
        kind = "pt" if args.task == "pretraining" and not args.user_script else "hf"
        refuse_unused(args, (kind, "mg"), error=ConfigError)
        base = pretrain_megatron.engine_config(args, accelerations=False)
        base = initialize(base)  # process groups, then seeds: the engine's order, so the hooks draw the same numbers
        run = pretrain_megatron.MegatronRun(args, base.world_size)  # the engine's side, if the model is a Megatron one
        if args.save is None:
            log.info("--save not given: no checkpoints are written")
        counts = sample_counts(base)
        log.info(f"samples to draw: train {counts[0]} ({base.train_iters} iterations of {base.global_batch_size}), "
                 f"validation {counts[1]}, test {counts[2]} (evaluation every {base.eval_interval} iterations on "
                 f"{base.eval_iters} batches); the datasets may hold more: whole passes over each split")
        train_ds, valid_ds, test_ds = self.train_valid_test_datasets_provider(list(counts))
        if train_ds is None:
            raise ValueError("train_valid_test_datasets_provider() returned no training dataset: check --split "
                             f"{args.split} and --data-path {args.data_path}")
        with model_run(run.build_stage_model):  # what GPTModel() in the user's hook builds
            model, optimizer, scheduler = self.model_optimizer_lr_scheduler_provider()
        if pretrain_megatron.is_megatron_model(model):
            cfg = run.config()  # what GPTModel() built from
            if optimizer is not None or scheduler is not None:
                log.warning("a Megatron model trains with the engine's optimizer and schedule (from --optimizers, "
                            "--lr, --lr-decay-style ...): the optimizer/scheduler from "
                            "model_optimizer_lr_scheduler_provider() are not used")
            refuse_unused(args, ("mg",), error=ConfigError)
            log.info("model: a megatron-core model: training with the engine (TP/PP schedules, ZeRO, recompute)")
            return pretrain_megatron.run(self, cfg, (train_ds, valid_ds, test_ds), model)
        from . import pretrain_hf
        from .rules.shape_flags import check_shape_flags

        refuse_unused(args, (kind,), error=ConfigError)
        check_shape_flags(args, model, "model_optimizer_lr_scheduler_provider()")
        return pretrain_hf.run(self, base, (train_ds, valid_ds, test_ds), model, optimizer, scheduler)

