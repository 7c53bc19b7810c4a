#!/usr/bin/env python3
"""Convert checkpoints between Hugging Face and the engine: see megatron_patch/conversion/convert.py.

    python tools/convert_checkpoint.py --direction hf2mcore --load-dir hf_model --save-dir ckpt \\
        --target-tensor-model-parallel-size 2 --target-pipeline-model-parallel-size 2 --verify
    python tools/convert_checkpoint.py --direction mcore2hf --load-dir ckpt --save-dir hf_out   # verified by default
"""
import sys

from megatron_patch.conversion.convert import main

if __name__ == "__main__":  # workers and dist_checkpointing start processes: keep the guard
    sys.exit(main())
