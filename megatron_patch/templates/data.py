"""Data loading for the templates: each worker's shard of a dataset, batches moved to the device, and
`gather` for metrics that puts the workers' results back in dataset order."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict) or hasattr(batch, "items"):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class DeviceLoader:
    """A DataLoader whose batches arrive on the device. For an evaluation loader it also records, while its
    last batch is out, how many of the samples in flight are the sampler's padding (repeats that make every
    worker's share equal), so `gather` can drop them."""

    def __init__(self, loader: DataLoader, device: torch.device, padding: int, tracker: "GatherState") -> None:
        self.loader, self.device, self.padding, self.tracker = loader, device, padding, tracker
        self.dataset, self.batch_size = loader.dataset, loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def sampler(self):
        return self.loader.sampler

    def __iter__(self):
        last = len(self.loader) - 1
        try:
            for i, batch in enumerate(self.loader):
                self.tracker.padding = self.padding if i == last else 0
                yield to_device(batch, self.device)
        finally:
            self.tracker.padding = 0


class GatherState:
    padding: int = 0


def build_loader(dataset, batch_size: int, shuffle: bool, collate_fn: Optional[Callable], seed: int,
                 device: torch.device, tracker: GatherState, num_workers: int = 0, drop_last: bool = False) -> DeviceLoader:
    """Every worker reads its own share; shares are made equal (the sampler repeats samples at the end), so
    the workers run the same number of steps, which the collectives of DDP and FSDP need."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    generator = torch.Generator().manual_seed(seed)  # worker seeds do not draw from the global generator
    # pinned host batches: the copy to the GPU runs asynchronously, behind the previous step's kernels
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                        num_workers=num_workers, generator=generator, drop_last=drop_last,
                        pin_memory=torch.device(device).type == "cuda")
    padding = 0 if drop_last else sampler.total_size - len(dataset)
    return DeviceLoader(loader, device, padding, tracker)


def gather(tensor: torch.Tensor, tracker: GatherState) -> torch.Tensor:
    """All workers' `tensor`s for the current batch, in dataset order, without the sampler's padding.

    Worker r holds samples r, r+W, r+2W, ... of each stretch of the dataset, so stacking the workers'
    batches and reading them sample-major restores the order. Tensors whose trailing sizes differ between
    workers (dynamic padding) are padded with -100 to the largest."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return tensor
    world = dist.get_world_size()
    shape = torch.tensor(tensor.shape, dtype=torch.long, device=tensor.device)
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    biggest = torch.stack(shapes).max(dim=0).values.tolist()
    padded = tensor.new_full(biggest, -100)
    padded[tuple(slice(0, s) for s in tensor.shape)] = tensor
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous())
    out = torch.stack(parts, dim=1).reshape(-1, *biggest[1:]) if tensor.dim() else torch.stack(parts)
    if tracker.padding:
        out = out[: out.shape[0] - tracker.padding]
    return out
