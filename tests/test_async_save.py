"""--async-save (training/checkpoint/async_save.py): the staged copy a background write reads is a copy (training may
change the live tensors meanwhile), and the flag's refusal. The kill during an asynchronous save, then the resume from
the previous checkpoint with the uninterrupted run's losses: tests/test_restart.py."""
from __future__ import annotations

import pytest
import torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

from engine_utils import TINY
from megatron_patch.compat.checkpoint_writer import staged_async_write
from megatron_patch.config import ConfigError
from megatron_patch.config.arguments import parse_args


def test_the_background_write_reads_a_copy_staged_at_the_save():
    live = torch.arange(6.0)
    written = {}

    def write(rank, buckets, queue):
        written["data"] = buckets[0][2][1][0][1].clone()

    request = AsyncRequest(write, (0, [("f.distcp", "key", ([], [("item", live)]))], None), [])
    fn, args, kwargs = staged_async_write(request)
    live.add_(100.0)  # the next training step changes the weights in place before the thread writes
    fn(*args, **kwargs)
    assert torch.equal(written["data"], torch.arange(6.0))


def test_nothing_to_write_on_this_rank_is_no_write():
    assert staged_async_write(AsyncRequest(None, (), []))[0] is None


def test_async_save_with_zero_2_is_refused_in_words():
    with pytest.raises(ConfigError, match="--async-save writes megatron-core torch_dist checkpoints"):
        parse_args([*TINY, "--save", "/tmp/x", "--async-save", "--zero-2-memory-optimization", "--bf16"],
                   model="gpt").validate(2)
