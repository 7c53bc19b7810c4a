"""Finetuner.build_data_loader + gather on 2 gloo workers: every worker reads its share, and gathering puts
the evaluation results back in dataset order without the sampler's repeats (which even out the shares)."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_utils import free_port  # noqa: E402


def _worker(rank: int, world: int, port: int, n: int, batch: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron_patch.templates.data import GatherState, build_loader, gather

    state = GatherState()
    # items of different lengths: the gathered rows are padded to the longest with -100
    data = [{"id": torch.tensor(i), "tokens": torch.full((1 + i % 3,), i)} for i in range(n)]

    def collate(rows):
        width = max(len(r["tokens"]) for r in rows)
        tokens = torch.stack([torch.nn.functional.pad(r["tokens"], (0, width - len(r["tokens"])), value=-1)
                              for r in rows])
        return {"id": torch.stack([r["id"] for r in rows]), "tokens": tokens}

    loader = build_loader(data, batch, False, collate, seed=0, device=torch.device("cpu"), tracker=state)
    ids, firsts, mine = [], [], []
    for b in loader:
        mine += b["id"].tolist()
        ids += gather(b["id"], state).tolist()
        firsts += gather(b["tokens"], state)[:, 0].tolist()
    torch.save({"ids": ids, "firsts": firsts, "mine": mine}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_gather_restores_dataset_order_without_repeats(tmp_path):
    for n, batch in ((7, 2), (10, 3), (4, 4)):
        out = str(tmp_path / f"g{n}")
        mp.start_processes(_worker, args=(2, free_port(), n, batch, out), nprocs=2, start_method="spawn")
        r0, r1 = (torch.load(f"{out}.{r}", weights_only=True) for r in range(2))
        assert r0["ids"] == r1["ids"] == list(range(n)), (n, batch, r0["ids"])
        assert r0["firsts"] == list(range(n))  # the row of each id travelled with it
        share = -(-n // 2)  # equal shares (the sampler repeats samples to even them out)
        assert len(r0["mine"]) == len(r1["mine"]) == share and set(r0["mine"]) | set(r1["mine"]) == set(range(n))
