#!/usr/bin/env python3
"""Which TP/PP/VPP/DP/EP/ZeRO layout, micro batch and recompute for a model on N GPUs, and will it fit?

    python tools/plan_parallel.py --model llama3-8b --gpus 8 --gpu h100-80gb --seq-length 8192 --global-batch-size 128
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_patch.conversion.hf_source import parse_args  # noqa: E402  (reads a model directory's config.json)
from megatron_patch.planning.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(parse=parse_args))
