"""A Hugging Face model of one of the engine's presets, with random weights and a local tokenizer: what a new user
starts from here, where no model can be downloaded (`tools/build_hf_model.py`; the README's walkthrough).

The config.json is the one mcore2hf would write for the engine model of `--model-family F --model-size S` (the
family's table, conversion/tables), with the tokenizer's vocabulary and end-of-text token; transformers initialises
the weights (its own initializer, `--seed`). The tokenizer's files are saved next to the weights, so the directory
is complete: AutoTokenizer, AutoModelForCausalLM, `--load-hf`, `--tokenizer-model` all read it.
"""
from __future__ import annotations

import argparse
import os
from typing import List, Optional


def build(family: str, size: str, tokenizer_dir: str, save_dir: str, seed: int = 0,
          max_position_embeddings: Optional[int] = None) -> str:
    """Write the model directory; returns its config.json's architecture."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from megatron_patch.config import parse_args

    from . import tables

    cfg = parse_args(["--model-family", family, "--model-size", size, "--mock-data", "--vocab-size", "8"])
    cfg = cfg.replace(max_position_embeddings=max_position_embeddings or cfg.max_position_embeddings or 4096)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    eod = tok.eos_token_id
    config = tables.for_engine(cfg).hf_config(cfg, len(tok), eod)
    if tok.bos_token_id is not None:
        config["bos_token_id"] = tok.bos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    model.save_pretrained(save_dir)
    tok.save_pretrained(save_dir)
    return config["architectures"][0]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-family", required=True, help="an engine family with a Hugging Face equivalent: llama, "
                   "llama3, qwen2, qwen3, mistral, mixtral, qwen2_moe, qwen3_moe, deepseek_v2, gpt")
    p.add_argument("--model-size", default="tiny", help="a size preset of the family (default tiny)")
    p.add_argument("--tokenizer-dir", required=True, help="a Hugging Face tokenizer directory (tools/train_tokenizer.py "
                   "--type llama3|qwen makes one)")
    p.add_argument("--save-dir", required=True)
    p.add_argument("--max-position-embeddings", type=int, default=None, help="positions (default: the preset's, "
                   "else 4096)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not os.path.isdir(a.tokenizer_dir):
        p.error(f"--tokenizer-dir {a.tokenizer_dir}: no such directory (make one with tools/train_tokenizer.py "
                f"--type llama3|qwen)")
    if os.path.exists(os.path.join(a.save_dir, "config.json")):
        p.error(f"--save-dir {a.save_dir} already holds a model (config.json): choose another directory")
    try:
        arch = build(a.model_family, a.model_size, a.tokenizer_dir, a.save_dir, a.seed, a.max_position_embeddings)
    except ValueError as e:
        p.error(str(e))
    print(f"wrote {a.save_dir}: {arch} ({a.model_family} {a.model_size}, random weights, seed {a.seed}) with the "
          f"tokenizer of {a.tokenizer_dir}")
    return 0
