"""Backend of the torch loop's checkpoints (a Hugging Face/PyTorch model: DDP, ZeroRedundancyOptimizer, FSDP2),
with the engine's rules (`megatron_patch.config.checkpoint_layout`: the tracker, the manifest written last, atomic
publication), and `TorchCheckpointer`, the component that decides when to save:

    {save}/latest_checkpointed_iteration.txt   the tracker: the newest published iteration
    {save}/iter_0000100/dcp/                   model and optimizer, torch.distributed.checkpoint, keyed by
                                               parameter name (FSDP2 shards and ZeRO-1 shards included)
    {save}/iter_0000100/train_state.pt         lr scheduler state, the param groups' weight decay and the
                                               loss scaler (the same on every worker)
    {save}/iter_0000100/rank_00000.pt          each worker's random streams (the engine's capture: rng.py)
    {save}/iter_0000100/checkpoint.json        written last: iteration, consumed training and validation
                                               samples, worker count, the settings of the lr schedule (as the
                                               engine stores them: config/resume.py compares them on resume),
                                               the size of every file

Written into `iter_N.tmp/` and renamed once the manifest is in, then the tracker moves: a crash leaves the
previous checkpoint or the new one complete. Loading takes the newest complete checkpoint (a missing or
truncated file makes the tracker's one fall back, with a warning), and reads every file without running code:
`torch.load(weights_only=True)` (RNG states are plain tensors and ints) and DCP through the safe-loading patches.
The format ("hf_dcp") is the one the Hugging Face PreTrainer wrote before the torch loop existed
(tests/data/hf_checkpoint_v1): those checkpoints load unchanged.

Another worker count resumes through DCP's `get_state_dict`/`set_state_dict`: the optimizer state is saved
flat, one entry per parameter name, so ZeroRedundancyOptimizer's shards (each worker's local optimizer over its
parameters), FSDP2's DTensors and plain DDP replicas all load into any other layout. The data position is in
samples (global batch k is samples [k*gbs, (k+1)*gbs)), so it carries over; each worker's random streams do not
(there is no way to split or merge them), and start from --seed, said in the log.
"""
from __future__ import annotations

import contextlib
import os
import pickle
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_patch.config.resume import HF_FORMAT
from megatron_patch.config import checkpoint_layout as directory
from megatron_patch.config.checkpoint_layout import CheckpointError, checkpoint_dir

from .atomic import write_checkpoint
from .state import SaveSchedule, TrainState

FORMAT = HF_FORMAT
LEGACY_TRACKER = "latest_iteration.txt"  # the tracker before this layout: rank files pickled numpy RNG state
TRAIN_STATE = "train_state.pt"


def _world() -> Tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank_{rank:05d}.pt")


def _local_optimizer(optimizer):
    """The optimizer whose state is keyed by this worker's parameters: ZeroRedundancyOptimizer's local one
    (over this worker's shard of the parameters), or the optimizer itself."""
    return optimizer.optim if type(optimizer).__name__ == "ZeroRedundancyOptimizer" else optimizer


@contextlib.contextmanager
def _without_empty_groups(optimizer):
    """The optimizer with its empty param groups hidden, then put back in place.

    A ZeRO-1 worker's local optimizer has a group with no parameters when the partition gives all of that
    group's parameters to other workers, and DCP's set_state_dict fails on it (torch 2.11,
    torch/distributed/checkpoint/state_dict.py:_unflatten_optim_state_dict reads the group's first parameter
    name; get_state_dict handles it). An empty group has nothing to load; the groups load_state_dict puts in
    place of the others are kept. Nothing steps the optimizer meanwhile (its state exists: get_state_dict made it),
    so no code sees the shortened list beside a list of the same length (CPUOffloadOptimizer's inner groups)."""
    groups = optimizer.param_groups
    if all(g["params"] for g in groups):
        yield optimizer
        return
    optimizer.param_groups = [g for g in groups if g["params"]]
    try:
        yield optimizer
    finally:
        loaded = iter(optimizer.param_groups)
        optimizer.param_groups = [next(loaded) if g["params"] else g for g in groups]


def _state_dicts(model, optimizer):
    """(model, optimizer) state dicts keyed by parameter name, flat: one entry per parameter and state, so that
    DCP reshards them to any worker count (a ZeRO-1 worker holds only the entries of its own parameters)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from megatron_patch.accelerations.data_parallel import unwrap

    return get_state_dict(unwrap(model), _local_optimizer(optimizer),
                          options=StateDictOptions(flatten_optimizer_state_dict=True))


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, precision, consumed_samples: int,
                    consumed_valid_samples: int, schedule: Optional[Dict] = None) -> str:
    """Write `root/iter_N/` (collective: every worker calls it) and point the tracker at it; returns its path.
    `schedule`: the manifest's entries for the schedule in effect ("scheduler" settings, "config" train_iters and
    global_batch_size; none for a scheduler of the user's own)."""
    import torch.distributed.checkpoint as dcp

    from . import rng

    rank, world = _world()

    def write_files(tmp: str) -> None:
        model_sd, optim_sd = _state_dicts(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=os.path.join(tmp, "dcp"))
        torch.save(rng.capture(), _rank_file(tmp, rank))
        if rank == 0:
            # the weight decay of each param group as this worker's optimizer applies it (a ZeRO-1 wrapper's
            # groups, not its local shard's): what --use-checkpoint-opt-param-scheduler restores
            torch.save({"scheduler": scheduler.state_dict(), "scaler": precision.state_dict(),
                        "weight_decay": [g.get("weight_decay") for g in optimizer.param_groups]},
                       os.path.join(tmp, TRAIN_STATE))

    return write_checkpoint(root, iteration, write_files, lambda: {
        "iteration": iteration, "consumed_samples": consumed_samples,
        "consumed_valid_samples": consumed_valid_samples, "world_size": world, "format": FORMAT,
        "versions": {"torch": torch.__version__}, **(schedule or {})})


def find_checkpoint(root: str) -> Tuple[Optional[int], List[str]]:
    """(iteration to resume from, warnings): the tracker's checkpoint when it is complete, else the newest
    complete one before it; (None, []) when `root` holds no checkpoint. CheckpointError when none is usable."""
    if not os.path.isfile(os.path.join(root, directory.TRACKER)) and \
            os.path.isfile(os.path.join(root, LEGACY_TRACKER)):
        raise CheckpointError(f"--load {root}: a checkpoint of an earlier megatron_patch ({LEGACY_TRACKER}, no "
                              f"{directory.MANIFEST}); its rank_*.pt files hold pickled RNG state that loading with "
                              f"weights_only=True refuses. Resume it with the version that wrote it, or start "
                              f"without --load")
    return directory.select_checkpoint(root)


def _load_file(path: str):
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(_refusal(path, e)) from None


def _refusal(path: str, e: BaseException) -> str:
    return (f"{path}: {directory.refused_unpickling(e)} Loading a checkpoint never runs code it contains; this one "
            f"was not written by megatron_patch or has been tampered with")


def load_checkpoint(root: str, iteration: int, model, optimizer, scheduler, precision) -> Dict:
    """Restore checkpoint `iteration` under `root` (chosen by `find_checkpoint`) into the accelerated model,
    optimizer, scheduler and loss scaler, and this worker's random streams when the worker count is the
    checkpoint's. Returns its manifest, with `notes` (phrases for the log line) and `weight_decay` (the param
    groups' as saved; None from a checkpoint that has none). The lr is set from the scheduler's saved state: a
    schedule of the flags is then re-applied at the restored step (`resume_hf.continue_schedule`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from megatron_patch.compat import apply_safe_loading, safe_loading
    from . import rng

    from megatron_patch.accelerations.data_parallel import unwrap

    rank, world = _world()
    path = checkpoint_dir(root, iteration)
    manifest = directory.read_manifest(path)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"--load {path}: a checkpoint of the engine ({manifest.get('format')} format), not of "
                              f"a Hugging Face/PyTorch model's PreTrainer; load it with a megatron-core model, or "
                              f"convert it with tools/convert_checkpoint.py --direction mcore2hf")
    apply_safe_loading()  # DCP's .metadata and its non-tensor entries unpickle through allow-lists
    states = os.path.join(path, "dcp")
    model_sd, optim_sd = _state_dicts(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    try:
        safe_loading.check_metadata(states)  # DCP itself would swallow the refusal into "metadata is None"
        dcp.load(state, checkpoint_id=states)
    except (pickle.UnpicklingError, CheckpointException) as e:
        if directory.refused_unpickling(e) is None:
            raise
        raise CheckpointError(_refusal(states, e)) from None
    with _without_empty_groups(_local_optimizer(optimizer)) as optim:
        set_state_dict(unwrap(model), optim, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(flatten_optimizer_state_dict=True))
    train_state = _load_file(os.path.join(path, TRAIN_STATE))
    scheduler.load_state_dict(train_state["scheduler"])
    # LambdaLR's load_state_dict does not touch the optimizer, and ZeroRedundancyOptimizer copies its own
    # param_groups' lr into the local shard's at each step: set the resumed rate where both read it
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
    precision.load_state_dict(train_state["scaler"])
    notes = []
    saved_world = manifest["world_size"]
    if saved_world == world:
        rng.restore(_load_file(_rank_file(path, rank)))
    else:
        notes.append(f"saved by {saved_world} worker(s), resumed by {world}: model and optimizer resharded by "
                     f"torch.distributed.checkpoint, data position carried over (it counts samples); random "
                     f"streams start from --seed (a worker's stream does not carry over to another worker count, so "
                     f"dropout draws differ from the uninterrupted run)")
    return dict(manifest, notes=notes, weight_decay=train_state.get("weight_decay"))


class TorchCheckpointer(SaveSchedule):
    """The torch loop's checkpoints under `save` (None: none are written), torchtitan-style: the loop calls
    `save(state)` after every step and `save(state, stopping=True)` once it ends, and `SaveSchedule.should_save`
    (the engine Checkpointer's rule) decides: every `interval` steps (0: only at the end), and when training stops
    unless that step is saved already or the run trained no step. `attach()` hands it what it saves; `load()`
    resumes a checkpoint `find_checkpoint` chose. `schedule`: the manifest's entries for the lr schedule in effect
    (see `save_checkpoint`)."""

    def __init__(self, save: Optional[str], interval: int, schedule: Optional[Dict] = None, log=print) -> None:
        super().__init__(save, interval)
        self.schedule, self.log = schedule, log
        self.parts: Tuple = ()
        self.start = 0  # the step this run started from (a resumed run's checkpoint)

    def attach(self, model, optimizer, scheduler, precision) -> None:
        self.parts = (model, optimizer, scheduler, precision)

    def load(self, root: str, iteration: int) -> Dict:
        """Restore checkpoint `iteration` of `root` into the attached parts (see `load_checkpoint`)."""
        state = load_checkpoint(root, iteration, *self.parts)
        self.start, self.last_saved = iteration, (iteration if root == self.root else None)
        return state

    def save(self, state: TrainState, stopping: bool = False) -> Optional[str]:
        """Write a checkpoint of `state` (its iteration, consumed_samples, consumed_valid_samples) when it is time;
        collective. Returns its directory, or None when nothing was written."""
        if not self.should_save(state.iteration, stopping):
            return None
        saved = save_checkpoint(self.root, state.iteration, *self.parts, state.consumed_samples,
                                state.consumed_valid_samples, self.schedule)
        self.last_saved = state.iteration
        self.log(f"saved checkpoint {saved}")
        return saved
