#!/usr/bin/env python3
"""Build a JSONL corpus of real text, offline, from the docstrings and documentation files of the installed Python
and its packages (see --help and megatron_patch/demo/package_text.py).

Example: tools/build_text_corpus.py --output data/real_text/corpus.jsonl --code-text comments
"""
from megatron_patch.demo.package_text import main

if __name__ == "__main__":
    main()
