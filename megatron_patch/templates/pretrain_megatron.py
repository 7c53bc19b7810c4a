"""The PreTrainer with a Megatron model: the user's hooks drive the engine's Trainer (megatron_patch.training).

The engine's order is kept (process groups and seeds, then datasets, then the model, then the wrappers,
optimizer and schedule), so the same flags give the same samples, weights and losses as
`pretrain_megatron_gpt.py`. The user's `run_forward_step(data_iterator, model)` returns a loss; megatron-core's
schedules want `(output, loss_func)` from every pipeline stage, and hidden states from every stage but the
last. `_StageModel` stands for the model in the user's code: it records what the real model chunk returned,
and on a stage that is not the last gives the user's loss code per-token zeros of the right shape, so the
code runs as written while the schedule sends the recorded hidden states on.
"""
from __future__ import annotations

import argparse
from typing import List, Optional

import torch

from megatron_patch.config import Config

from .engine_config import engine_config  # (tests import it from here too)


class MegatronRun:
    """The engine side of one PreTrainer run, handed around explicitly (no module globals): the `rapidformer` flags
    `args` of a world of `world_size` processes, their engine Config with every switch (ZeRO, precision,
    recompute), and this rank's model chunks built from it, which GPTModel() in the user's hook returns
    (PreTrainer.train enters `models.run_context.model_run(run.build_stage_model)` around the hook)."""

    def __init__(self, args: argparse.Namespace, world_size: int) -> None:
        self.args, self.world_size = args, world_size
        self._config: Optional[Config] = None

    def config(self) -> Config:
        """The engine Config GPTModel() builds from. Built and validated on first use, so a Hugging Face run
        never needs it."""
        if self._config is None:
            self._config = engine_config(self.args).validate(self.world_size)
        return self._config

    def build_stage_model(self) -> List[torch.nn.Module]:
        """This rank's model chunks, built as `pretrain_megatron_gpt.py` builds them (the vocabulary of
        --tokenizer-type/--vocab-file, the model switches). (`rapidformer` has no --load-hf: a PreTrainer run
        starts from its --load or from initialised weights.)"""
        from megatron_patch.models.build import build_model_chunks, model_vocab_size
        from megatron_patch.training.data import tokenizer_from_config

        cfg = self.config()
        return build_model_chunks(cfg, model_vocab_size(cfg, tokenizer_from_config(cfg)))


def is_megatron_model(model) -> bool:
    """A megatron-core module (or a list of them, one per virtual pipeline stage)."""
    from megatron.core.transformer.module import MegatronModule

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return bool(chunks) and all(isinstance(c, MegatronModule) for c in chunks)


class _StageModel:
    """The `model` the user's run_forward_step calls: the real chunk, whose output is recorded."""

    def __init__(self, chunk: torch.nn.Module, last: bool) -> None:
        self._chunk, self._last, self.output = chunk, last, None

    def __call__(self, *args, **kwargs):
        out = self._chunk(*args, **kwargs)
        self.output = out
        if self._last:
            return out
        # Not the last stage: `out` is hidden states [s, b, h] for the next stage. The user's code computes a
        # loss from per-token losses [b, s]; zeros let it run, and its result is not used.
        tokens = args[0] if args else kwargs.get("input_ids")
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else (out.shape[1], out.shape[0])
        return torch.zeros(shape, dtype=torch.float32, device=out.device)

    def __getattr__(self, name: str):
        return getattr(self._chunk, name)


def _loss_func(loss: torch.Tensor):
    def loss_func(output_tensor):
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place
    return loss_func


def megatron_forward_step(run_forward_step):
    """megatron-core's forward-step function around the user's `run_forward_step(data_iterator, model)`."""
    from megatron_patch.training.step import no_loss, stage_flags

    def forward_step(data_iterator, model):
        last = stage_flags(model)[1]
        stage = _StageModel(model, last)
        loss = run_forward_step(data_iterator, stage)
        if stage.output is None:
            raise RuntimeError("run_forward_step(data_iterator, model) returned without calling model(...): the "
                               "pipeline needs the model's output")
        if last:
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError("run_forward_step(data_iterator, model) must return the loss as a 0-dim tensor, got "
                                f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
            return loss, _loss_func(loss)
        return stage.output, no_loss
    return forward_step


def run(pretrainer, cfg: Config, datasets, model) -> List[dict]:
    """Train a Megatron model with the engine: `datasets` and `model` come from the user's hooks."""
    from megatron.core import parallel_state as mpu

    from megatron_patch.training.data import build_iterator
    from megatron_patch.training.loop import Trainer

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    forward = megatron_forward_step(pretrainer.run_forward_step)

    class TemplateTrainer(Trainer):
        def _initialize(self, c: Config) -> Config:
            return c  # process groups and seeds were set before the hooks ran, as the engine orders them

        def _build_datasets(self):
            return datasets

        def _build_chunks(self, vocab: int) -> List[torch.nn.Module]:
            return chunks

        def _forward_step_func(self):
            return forward

        def _reads_data(self, chunk) -> bool:
            # the user's run_forward_step reads on every stage; its broadcast_data serves the other TP ranks
            return mpu.get_tensor_model_parallel_rank() == 0

        def _iterator(self, dataset, consumed: int, cycle: bool):
            return build_iterator(dataset, self.cfg, consumed, cycle) if dataset is not None else None

    trainer = TemplateTrainer(cfg)
    pretrainer.trainer = trainer
    return trainer.train()
