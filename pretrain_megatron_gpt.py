#!/usr/bin/env python3
"""Pretrain a GPT/Llama-family model with megatron-core. Launch with torchrun (or plainly for one process):

    torchrun --nproc-per-node 8 pretrain_megatron_gpt.py --model-family llama --model-size 1.3b --bf16 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --data-path my_text_document ...

`pretrain_scripts/run_gpt.sh` wraps this with defaults. `--help` lists every flag.
"""
import sys
import warnings

# megatron-core announces at import time that it falls back to torch kernels without TE/apex; the
# run's own log says which implementation it uses.
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|absl|GPTModel IS DEPRECATED).*")

from megatron_patch.config import ConfigError, parse_args
from megatron_patch.parallel import destroy


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
        from megatron_patch.training.loop import pretrain

        pretrain(cfg)
    except ConfigError as e:
        print(f"configuration error: {e}", file=sys.stderr)
        return 2
    finally:
        destroy()
    return 0


if __name__ == "__main__":  # dist_checkpointing starts helper processes: keep the guard
    sys.exit(main())
