#!/usr/bin/env python3
"""Loss curves of several --metrics-file runs in one PNG: see megatron_patch/training/plot_metrics.py.

    python tools/plot_metrics.py work_dirs/bf16/metrics.jsonl work_dirs/fp8/metrics.jsonl -o curves.png \\
        --smooth 20 --validation --relative-to-first
"""
import sys

from megatron_patch.training.plot_metrics import main

if __name__ == "__main__":
    sys.exit(main())
