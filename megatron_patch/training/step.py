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


def packed_seq_params(position_ids: torch.Tensor):
    """megatron-core's THD description of a micro batch flattened into one sequence, whose conversations (and each
    sample's padding) start where `position_ids` are 0: cumulative lengths and the longest (read on the host: RoPE's
    table is built for it)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).view(-1)
    cu = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def forward_step(data_iterator, model, packed: bool = False, per_token_loss: bool = False):
    """One micro batch through one model chunk; returns the output and the loss function.

    Only chunks that embed tokens (first stage) or compute the loss (last stage) need the batch, and of a
    tensor-parallel group only rank 0 reads it: `broadcast_data` sends it to the others (Megatron-LM's way).
    Stages in between take their input from the previous stage; with `packed` sequences they read the positions
    too, which say where each conversation starts.

    `packed`: the micro batch [b, s] runs as one sequence of b*s tokens (megatron-core's THD format), attention and
    RoPE restricted to each conversation. `per_token_loss`: the loss function returns the sum of the micro batch's
    token losses and their count; megatron-core adds the counts over the global batch (micro batches, data-parallel
    ranks) and divides the gradients by the total, so every loss token of the global batch weighs the same however
    conversations are packed into samples and samples into micro batches (Megatron-LM's --calculate-per-token-loss).
    Otherwise each micro batch's mean counts 1/(micro batches)."""
    from megatron_patch.parallel.broadcast import broadcast_data

    pre, post = stage_flags(model)
    if not (pre or post):
        if not packed:
            return model(None, None, None), no_loss
        batch = broadcast_data(["position_ids"], next(data_iterator) if data_iterator is not None else None, torch.int64)
        return model(None, None, None, packed_seq_params=packed_seq_params(batch["position_ids"])), no_loss
    batch = next(data_iterator) if data_iterator is not None else None
    batch = broadcast_data(BATCH_KEYS, batch, torch.int64)  # one int64 buffer: loss_mask is 0/1
    tokens, labels, position_ids = batch["tokens"], batch["labels"], batch["position_ids"]
    loss_mask = batch["loss_mask"].float()
    if packed:
        params = packed_seq_params(position_ids)
        tokens, labels, position_ids = (t.reshape(1, -1) for t in (tokens, labels, position_ids))
        output = model(tokens, position_ids, None, labels=labels, packed_seq_params=params)
    else:
        output = model(tokens, position_ids, None, labels=labels)

    def loss_func(output_tensor):
        losses = output_tensor.float()
        total = loss_mask.sum()
        summed = (losses.view(-1) * loss_mask.view(-1)).sum()
        if per_token_loss:  # reported as [sum, count]: mean_losses divides the totals
            return summed, total.detach().to(torch.int), {"lm loss": torch.stack([summed.detach(), total])}
        loss = summed / total.clamp(min=1)
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place

    return output, loss_func


def no_loss(output_tensor):
    """The loss function of a pipeline stage that is not the last (the schedule never calls it)."""
    raise RuntimeError("internal: a loss function was called on a pipeline stage that is not the last")


def mean_losses(losses: List[Dict[str, torch.Tensor]], keys: Sequence[str] = ("lm loss",)) -> Dict[str, torch.Tensor]:
    """Mean of each reported loss (`keys`: "lm loss", and for BERT "sop loss") over the micro batches of the
    global batch, known on every rank afterwards (only the last pipeline stage computes them): 0-dim tensors on
    the device (NaN without micro batches), so that nothing waits for the GPU here. A loss reported as [sum, count]
    (per-token loss) is the total sum over the total count instead."""
    t = torch.zeros(len(keys) + 1, device=current_device())
    if mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0 and losses:
        if losses[0][keys[0]].numel() == 2:
            sums = torch.stack([torch.stack([x[key].float() for x in losses]).sum(0) for key in keys])
            t[:-1], t[-1] = sums[:, 0], sums[0, 1]
        else:
            t[:-1] = torch.stack([torch.stack([x[key].float().reshape(()) for x in losses]).sum() for key in keys])
            t[-1:].fill_(len(losses))  # a fill kernel (assigning a Python number copies it from the host: a wait)
    dist.all_reduce(t)
    means = torch.where(t[-1] > 0, t[:-1] / t[-1].clamp(min=1), torch.full_like(t[:-1], float("nan")))
    return {key: means[i] for i, key in enumerate(keys)}


def materialize(metrics: Dict) -> Dict:
    """`metrics` with every tensor value replaced by its float (one transfer from the device for all scalars), or
    by its nested list for a tensor of several values (integer tensors: ints), in place."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor) and v.numel() == 1]
    if keys:
        values = torch.stack([metrics[k].detach().float().reshape(()) for k in keys]).tolist()
        metrics.update(zip(keys, values))
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor):
            metrics[k] = v.detach().tolist()
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
