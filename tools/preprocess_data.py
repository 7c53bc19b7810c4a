#!/usr/bin/env python3
"""JSONL -> Megatron .bin/.idx (Megatron-LM's interface; see --help)."""
from megatron_patch.data.preprocess import main

if __name__ == "__main__":
    main()
