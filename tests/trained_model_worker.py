"""One process of tests/test_conversion_export.py: the engine trains a model (its Trainer, as
pretrain_megatron_gpt.py runs it, saving its checkpoint with --save), then the model it holds in memory runs
a fixed token batch, and its logits over the real vocabulary are written next to the tokens. The logits are
the engine's own forward (megatron-core's GPTModel called directly), not the conversion's verify.

    torchrun --nproc-per-node 1 tests/trained_model_worker.py OUT.pt <engine flags>
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree's engine

TOKENS_SEED = 123


def main(out: str, argv) -> None:
    import torch.distributed as dist

    from megatron_patch.config import parse_args
    from megatron_patch.parallel import destroy
    from megatron_patch.training.checkpoint.torch_dist import unwrap
    from megatron_patch.training.loop import Trainer

    try:
        trainer = Trainer(parse_args(list(argv)))
        trainer.train()
        cfg = trainer.cfg
        assert dist.get_world_size() == 1, "the logits are taken from a single-process model"
        model = unwrap(trainer.model[0]).eval()
        vocab = model.true_vocab_size
        tokens = torch.randint(0, vocab, (2, cfg.seq_length), generator=torch.Generator().manual_seed(TOKENS_SEED))
        positions = torch.arange(cfg.seq_length).unsqueeze(0).expand_as(tokens)
        with torch.no_grad():
            logits = model(tokens, positions, None)  # [b, s, padded vocabulary]
        torch.save({"tokens": tokens, "logits": logits[..., :vocab].float().clone(), "padded": logits.size(-1)}, out)
    finally:
        destroy()


if __name__ == "__main__":  # dist_checkpointing starts helper processes: keep the guard
    main(sys.argv[1], sys.argv[2:])
