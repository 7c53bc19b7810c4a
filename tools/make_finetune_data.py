#!/usr/bin/env python3
"""Write a small fine-tuning dataset for a --task from the stdlib's docstrings, offline (see --help).

Example: tools/make_finetune_data.py --task sequence_classification --output-dir data/mrpc_like \
             --train-samples 2000 --valid-samples 200 --test-samples 200 --seed 1234
"""
from megatron_patch.demo.task_files import main

if __name__ == "__main__":
    main()
