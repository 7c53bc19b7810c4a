#!/usr/bin/env python3
"""Pretrain BERT (masked LM + next-sentence prediction) with megatron-core, as Megatron-LM's pretrain_bert.py
does. Launch with torchrun (or plainly for one process):

    torchrun --nproc-per-node 4 pretrain_megatron_bert.py --model-size base --tensor-model-parallel-size 2 \\
        --data-path my_text_sentence --tokenizer-type BertWordPieceLowerCase --vocab-file vocab.txt ...

The data is sentence-split (`tools/preprocess_data.py --split-sentences` writes PREFIX_text_sentence).
`--bert-no-binary-head` trains the masked LM alone; `--mask-prob` (0.15) and `--short-seq-prob` (0.1) as in
Megatron-LM. `pretrain_scripts/run_bert.sh` wraps this with defaults. `--help` lists every flag.

Errors and `--validate-only` behave as in pretrain_megatron_gpt.py (megatron_patch.cli.pretrain).
"""
import sys

from megatron_patch.cli.pretrain import main  # light: no torch, no megatron-core

if __name__ == "__main__":  # dist_checkpointing starts helper processes: keep the guard
    sys.exit(main(model="bert"))
