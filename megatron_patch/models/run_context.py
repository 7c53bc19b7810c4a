"""The run a `GPTModel()` call builds for, made explicit: the PreTrainer enters it around the user's
`model_optimizer_lr_scheduler_provider()` (`with model_run(build): ...`), handing over how that run builds this
rank's model chunks; GPTModel() asks for them. The models layer so needs nothing from the layers above it (the
configuration, the tokenizer and --load-hf stay with the run that knows them)."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Optional

import torch

Build = Callable[[], List[torch.nn.Module]]

_RUN: Optional[Build] = None


@contextlib.contextmanager
def model_run(build: Build) -> Iterator[None]:
    """Within the block, GPTModel() returns `build()` (this rank's model chunks of the run under way)."""
    global _RUN
    previous, _RUN = _RUN, build
    try:
        yield
    finally:
        _RUN = previous


def current_build() -> Build:
    """The model builder of the run under way; RuntimeError (saying where GPTModel() belongs) outside one."""
    if _RUN is None:
        raise RuntimeError("GPTModel() builds this rank's stage of the PreTrainer run's model: call it inside "
                           "model_optimizer_lr_scheduler_provider(), once PreTrainer.train() has started")
    return _RUN
