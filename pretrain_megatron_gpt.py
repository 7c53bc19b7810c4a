#!/usr/bin/env python3
"""Pretrain a GPT/Llama-family model with megatron-core. Launch with torchrun (or plainly for one process):

    torchrun --nproc-per-node 8 pretrain_megatron_gpt.py --model-family llama --model-size 1.3b --bf16 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --data-path my_text_document ...

`pretrain_scripts/run_gpt.sh` wraps this with defaults. `--help` lists every flag.

A configuration or data error is printed once (by local rank 0 of each machine) as `configuration error: ...` or `data error: ...`,
and every rank exits with status 2. `WORLD_SIZE=8 python pretrain_megatron_gpt.py ... --validate-only` makes
the same checks for 8 processes without starting any, which is what the launchers do before torchrun.
(The BERT entry point, pretrain_megatron_bert.py, shares this behaviour: megatron_patch.cli.pretrain.)
"""
import sys

from megatron_patch.cli.pretrain import describe, main  # light: no torch, no megatron-core  # noqa: F401

if __name__ == "__main__":  # dist_checkpointing starts helper processes: keep the guard
    sys.exit(main(model="gpt"))
