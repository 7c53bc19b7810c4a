#!/usr/bin/env python3
"""Train a GPT-2 BPE, SentencePiece or WordPiece tokenizer on local text (see --help)."""
from megatron_patch.data.train_tokenizer import main

if __name__ == "__main__":
    main()
