"""One micro batch and one global batch's numbers on megatron-core: the GPT forward step and its loss (the
`forward_step_func` of megatron-core's schedules), a model chunk's pipeline stage, the mean losses of a global
batch on every rank, the parameter count of the whole model, and the reads an iterator served."""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from megatron_patch.parallel import current_device


def stage_flags(chunk: torch.nn.Module) -> tuple:
    """(pre_process, post_process) of a model chunk, through its wrappers (DDP, Float16Module, FSDP)."""
    inner = chunk
    while not hasattr(inner, "pre_process") and isinstance(getattr(inner, "module", None), torch.nn.Module):
        inner = inner.module
    return bool(getattr(inner, "pre_process", True)), bool(getattr(inner, "post_process", True))


BATCH_KEYS = ["tokens", "labels", "loss_mask", "position_ids"]


def forward_step(data_iterator, model):
    """One micro batch through one model chunk; returns the output and the loss function.

    Only chunks that embed tokens (first stage) or compute the loss (last stage) need the batch, and of a
    tensor-parallel group only rank 0 reads it: `broadcast_data` sends it to the others (Megatron-LM's way).
    Stages in between take their input from the previous stage."""
    from megatron_patch.parallel.broadcast import broadcast_data

    pre, post = stage_flags(model)
    if not (pre or post):
        return model(None, None, None), no_loss
    batch = next(data_iterator) if data_iterator is not None else None
    batch = broadcast_data(BATCH_KEYS, batch, torch.int64)  # one int64 buffer: loss_mask is 0/1
    tokens, labels, position_ids = batch["tokens"], batch["labels"], batch["position_ids"]
    loss_mask = batch["loss_mask"].float()
    output = model(tokens, position_ids, None, labels=labels)

    def loss_func(output_tensor):
        losses = output_tensor.float()
        total = loss_mask.sum()
        loss = (losses.view(-1) * loss_mask.view(-1)).sum() / total.clamp(min=1)
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place

    return output, loss_func


def no_loss(output_tensor):
    """The loss function of a pipeline stage that is not the last (the schedule never calls it)."""
    raise RuntimeError("internal: a loss function was called on a pipeline stage that is not the last")


def mean_losses(losses: List[Dict[str, torch.Tensor]], keys: Sequence[str] = ("lm loss",)) -> Dict[str, torch.Tensor]:
    """Mean of each reported loss (`keys`: "lm loss", and for BERT "sop loss") over the micro batches of the
    global batch, known on every rank afterwards (only the last pipeline stage computes them): 0-dim tensors on
    the device (NaN without micro batches), so that nothing waits for the GPU here."""
    t = torch.zeros(len(keys) + 1, device=current_device())
    if mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0 and losses:
        t[:-1] = torch.stack([torch.stack([x[key].float().reshape(()) for x in losses]).sum() for key in keys])
        t[-1] = len(losses)
    dist.all_reduce(t)
    means = torch.where(t[-1] > 0, t[:-1] / t[-1].clamp(min=1), torch.full_like(t[:-1], float("nan")))
    return {key: means[i] for i, key in enumerate(keys)}


def materialize(metrics: Dict) -> Dict:
    """`metrics` with every tensor value replaced by its float (one transfer from the device for all), in place."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    if keys:
        values = torch.stack([metrics[k].detach().float().reshape(()) for k in keys]).tolist()
        metrics.update(zip(keys, values))
    return metrics


def count_parameters(model) -> int:
    """Parameters of the whole model (all TP/PP/EP ranks), each counted once."""
    local, experts = 0, 0
    for chunk in model:
        for name, p in chunk.named_parameters():
            if getattr(p, "shared", False) and not mpu.is_pipeline_first_stage(ignore_virtual=True):
                continue  # a tied output layer on the last stage repeats the embedding
            if ".mlp.experts." in name:  # routed experts: sliced over ETP, spread over EP
                experts += p.numel()
            else:
                local += p.numel()
    t = torch.tensor([local], dtype=torch.float64, device=current_device())
    dist.all_reduce(t, group=mpu.get_model_parallel_group())
    e = torch.tensor([experts], dtype=torch.float64, device=current_device())
    dist.all_reduce(e, group=mpu.get_expert_tensor_model_pipeline_parallel_group())
    return int(t.item() + e.item())


class CountingIterator:
    """An iterator that counts what is drawn from it (the data reads the log reports)."""

    def __init__(self, it) -> None:
        self.it, self.count = it, 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.it)
        self.count += 1
        return item
