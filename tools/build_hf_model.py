#!/usr/bin/env python3
"""A Hugging Face model of an engine preset with random weights and a local tokenizer (see --help)."""
import sys

from megatron_patch.conversion.build_hf import main

if __name__ == "__main__":
    sys.exit(main())
