"""The torch loop's parts in one process (templates/torch_loop.py, training/checkpoint/torch_dcp.py), on a tiny
torch model: the stop rules (steps, epochs, whichever first), when the validator evaluates, when the checkpointer
saves, and the loop's epochs over a DataLoader. (In process, about 2 s in all.)"""
from __future__ import annotations

import argparse
import os

import pytest
import torch

from megatron_patch.accelerations.precision import Precision
from megatron_patch.templates.reporting import LoopReporter
from megatron_patch.templates.torch_loop import (
    EpochBatches, TrainState, Stop, TorchLoop, TrainStep, Validator,
)


def _args(tmp_path, log_interval=1):
    return argparse.Namespace(log_interval=log_interval, tensorboard_dir=None,
                              metrics_file=str(tmp_path / "metrics.jsonl"))


def _parts(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


def _loop(tmp_path, n_rows, micro, accum, stop, every=0, checkpointer=None, log_interval=1, clip=0.0, total=None):
    """A TorchLoop over `n_rows` rows (id in column 0) in micro batches of `micro`; records the ids each step
    trained on and the steps at which it evaluated."""
    model, optimizer, scheduler = _parts()
    rows = torch.cat([torch.arange(n_rows, dtype=torch.float32)[:, None], torch.randn(n_rows, 2)], dim=1)
    loader = torch.utils.data.DataLoader(rows, batch_size=micro, shuffle=False)
    seen, evaluations = [], []

    def forward(batch, model):
        seen.append(batch[:, 0].long().tolist())
        return model(batch).square().mean()

    def evaluate(progress, when):
        evaluations.append((when, progress.epoch, progress.iteration))
        return {"step": progress.iteration}

    precision = Precision(None, torch.device("cpu"))
    if checkpointer is not None:
        checkpointer.attach(model, optimizer, scheduler, precision)
    data = EpochBatches(loader, accum, world=1)
    stop_rule = Stop(**stop)
    total = total or stop_rule.steps or stop_rule.epochs * data.steps_per_epoch
    reporter = LoopReporter(_args(tmp_path, log_interval), 0, total, "step", stop_rule.epochs)
    validator = Validator(evaluate, every=every, at_start=True, each_epoch=True)
    step = TrainStep(model, optimizer, scheduler, precision, forward, clip)
    loop = TorchLoop(model, step, data, stop_rule, validator, reporter, checkpointer)
    return loop.train(TrainState()), seen, evaluations, validator, reporter


def test_epochs_are_a_stop_rule_and_each_epoch_is_evaluated_once(tmp_path):
    """10 rows, micro batch 2, accumulation 2: 2 steps an epoch (the fifth micro batch is a partial accumulation,
    not a step). 3 epochs: 6 steps, an evaluation before training and after each epoch, --eval-interval 2 evaluates
    at steps 2, 4 and 6, which end epochs, so never twice at one step."""
    progress, seen, evaluations, validator, reporter = _loop(tmp_path, 10, 2, 2, dict(epochs=3), every=2)
    assert (progress.iteration, progress.epoch) == (6, 3)
    assert seen == [[0, 1], [2, 3], [4, 5], [6, 7]] * 3
    assert evaluations == [("start", 1, 0), ("step", 1, 2), ("step", 2, 4), ("step", 3, 6)]
    assert validator.last == {"step": 6}
    assert [r["iteration"] for r in reporter.history] == [1, 2, 3, 4, 5, 6]


def test_each_step_keeps_its_own_loss_and_gradient_norm_when_read_at_the_log_line(tmp_path):
    """The reporter reads the steps' losses and gradient norms at its --log-interval lines (and at close(), for
    steps after the last line: here the reporter expects 10 steps and the run stops at 7): every record holds its
    own step's values, as when each step is read at once (--log-interval 1)."""
    def history(log_interval):
        *_, reporter = _loop(tmp_path, 8, 1, 1, dict(steps=7), log_interval=log_interval, clip=1.0, total=10)
        reporter.close()
        return [(r["iteration"], r["loss"], r["grad_norm"]) for r in reporter.history]

    each = history(1)
    assert [i for i, _, _ in each] == list(range(1, 8)) and len({n for _, _, n in each}) == 7  # distinct norms
    assert history(4) == each


def test_steps_stop_inside_an_epoch_whichever_rule_comes_first(tmp_path):
    """3 steps of 2-step epochs (the steps rule first: the second epoch ends early, then is evaluated); 5 epochs
    capped by 3 steps; and 1 epoch before 10 steps (the epochs rule first)."""
    progress, seen, evaluations, _, _ = _loop(tmp_path, 10, 2, 2, dict(steps=3, epochs=5))
    assert (progress.iteration, progress.epoch) == (3, 2) and len(seen) == 6
    assert evaluations == [("start", 1, 0), ("epoch", 1, 2), ("epoch", 2, 3)]
    progress, seen, evaluations, _, _ = _loop(tmp_path, 8, 2, 1, dict(steps=10, epochs=1))
    assert (progress.iteration, progress.epoch) == (4, 1) and evaluations[-1] == ("epoch", 1, 4)


def test_checkpointer_saves_every_interval_and_at_the_end_once(tmp_path):
    """--save-interval 3 over 7 steps: checkpoints 3, 6 and 7 (the end); a resumed run at its end saves nothing
    (it trained no step), and the resumed checkpoint restores the weights and where training stood."""
    from megatron_patch.config.checkpoint_layout import iterations_on_disk, read_tracker
    from megatron_patch.training.checkpoint.torch_dcp import TorchCheckpointer

    save = str(tmp_path / "ck")
    checkpointer = TorchCheckpointer(save, 3, log=lambda line: None)
    progress, *_ = _loop(tmp_path, 14, 1, 1, dict(steps=7), checkpointer=checkpointer)
    assert progress.iteration == 7 and checkpointer.last_saved == 7
    assert iterations_on_disk(save) == [3, 6, 7] and read_tracker(save) == 7
    trained = checkpointer.parts[0].weight.detach().clone()

    model, optimizer, scheduler = _parts(seed=1)
    other = str(tmp_path / "other")  # resumed from `save`, saving elsewhere
    again = TorchCheckpointer(other, 3, log=lambda line: None)
    again.attach(model, optimizer, scheduler, Precision(None, torch.device("cpu")))
    state = again.load(save, 7)
    assert (state["iteration"], state["consumed_samples"]) == (7, 7)
    assert torch.equal(model.weight, trained) and scheduler.last_epoch == 7
    assert again.save(TrainState(iteration=7), stopping=True) is None  # nothing trained since the checkpoint
    assert not os.path.exists(other)
    assert again.save(TrainState(iteration=8), stopping=True) == os.path.join(other, "iter_0000008")


@pytest.mark.parametrize("rule,progress,epoch_over,done", [
    (Stop(steps=4), TrainState(iteration=3), False, False), (Stop(steps=4), TrainState(iteration=4), False, True),
    (Stop(epochs=2), TrainState(iteration=9, epoch=2), False, False),
    (Stop(epochs=2), TrainState(iteration=9, epoch=2), True, True),
    (Stop(epochs=2), TrainState(iteration=9, epoch=1), True, False)])
def test_stop_rules(rule, progress, epoch_over, done):
    assert rule.done(progress, epoch_over) is done
