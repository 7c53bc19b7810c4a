"""Fine-tuning throughput: Hugging Face `Trainer` (its best settings) against `rapidformer`, same model, data and batch.

    python benchmarks/bench_finetune.py                 # BERT-base, batch 32, 30 warm-up + 100 timed steps
    python benchmarks/bench_finetune.py --tiny          # 2 layers, hidden 64, a few steps (CPU smoke test)
    python benchmarks/bench_finetune.py --arms trainer,rf --out /tmp/bf
    python benchmarks/bench_finetune.py --tiny --arms rf,rf_packed   # CPU: padding-free trains with rf's losses

Model: `BertForSequenceClassification(BertConfig())` (12 layers, hidden 768, vocab 30522, 2 labels), random
weights from --seed, SDPA attention. Data: --batch x (all steps) samples of random token ids, a sentence pair
([CLS] a [SEP] b [SEP], token_type_ids 0/1) of total length uniform in [--min-len, --max-len], random 0/1
labels; every batch is padded to its longest sample (dynamic padding) by one collator shared by all arms.

Arms (each in its own subprocess: separate peak memory and compile caches), all with lr --lr, linear decay to
0 over the same number of steps, weight decay 0.01 (not on biases and LayerNorm), clip 1.0, fused AdamW,
bf16 autocast over fp32 weights, DataLoader in the main process (--num-workers):
    trainer            transformers.Trainer, bf16=True, optim="adamw_torch_fused"
    trainer_compile    the same + torch_compile=True
    rf                 rapidformer's Finetuner.train() (the white/black-box loop) with --bf16
    rf_compile         --bf16 --torch-compile
    rf_graphs          --bf16 --torch-compile-mode reduce-overhead: compiled forward and backward replayed as
                       CUDA graphs, batches padded to a multiple of 64 tokens (the flag's default)
    trainer_graphs     the Trainer given the same: torch_compile_mode="reduce-overhead", batches padded to a
                       multiple of 64 (a setting the Trainer offers; not among the issue's "best settings")
    rf_ckpt            --bf16 --checkpoint-activations
    rf_packed          --bf16 --torch-compile-mode reduce-overhead --padding-free: each batch's samples concatenated
                       into one row of tokens padded to a multiple of 256 (--packed-multiple), positions restarting
                       per sample, attention within each sample (flash varlen kernels with the layer's dropout),
                       the model's own pooler/classifier/loss; CUDA graphs per token budget (about 10 here)
    rf_packed_eager    --bf16 --padding-free (the packing alone, eager)
The packed arms wrap the same padding collator (the samples, batches and order are the others'); their tokens/s
and TFLOP/s count the tokens of the packed rows (filler included) and attention over each sample alone, so they
compare with the padded arms' counts of padded work. The table's last lines compare each packed arm's per-step
losses with rf's (equal up to rounding with --tiny, which turns dropout off; with dropout on both draw other
random masks).
Every arm's clock runs from the start of forward step --warmup to the start of forward step --warmup + --steps
(torch.cuda.synchronize at both ends, and once in the middle: the table's two halves show an arm still
warming up), so the window holds --steps whole steps: forward, backward, clip, optimizer, scheduler, the
framework's per-step bookkeeping and the fetch of the next batch. With lengths 16-256 and batch 32 about 27
padded lengths occur, and a compiled arm was seen to speed up after the window (see RESULTS.md): give the
compile arms --warmup 100 or more. Both frameworks
draw the same permutation of the same samples (checked: the padded lengths of the batches are compared).
The eager arms (trainer, rf) then run --profile-steps steps under torch.profiler: GPU busy share, time per
kernel class, the top kernels and the top CPU operators, written to <out>/<arm>.log.

Prints one table last; per-arm logs and JSON results go to --out (default $OUT, else /tmp/bench_finetune).
--time-budget bounds the whole run (arms run in --arms order; one that would start too late is skipped).
Figures and notes: benchmarks/RESULTS.md, "Fine-tuning throughput".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_ARMS = ["trainer", "rf", "trainer_compile", "rf_compile", "rf_graphs", "trainer_graphs", "rf_ckpt", "rf_packed",
            "rf_packed_eager"]
RF_FLAGS = {"rf": [], "rf_compile": ["--torch-compile"], "rf_ckpt": ["--checkpoint-activations"],
            "rf_graphs": ["--torch-compile-mode", "reduce-overhead"],
            "rf_packed": ["--torch-compile-mode", "reduce-overhead", "--padding-free"],
            "rf_packed_eager": ["--padding-free"]}
PACKED = ("rf_packed", "rf_packed_eager")
GRAPH_PAD = 64  # the *_graphs arms pad batches to a multiple of this (rapidformer's default for CUDA graphs)
PROFILED = ("trainer", "rf")
CLS, SEP, PAD = 101, 102, 0


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true",
                   help="2 layers, hidden 64, 4 heads, lengths up to 64, 5+10 steps, no dropout (smoke test)")
    p.add_argument("--no-dropout", dest="dropout", action="store_false",
                   help="hidden and attention dropout 0 (then the packed arms' losses equal rf's)")
    p.add_argument("--packed-multiple", type=int, default=None,
                   help="the packed arms' token budgets: rows padded to a multiple of N tokens (--pad-to-multiple-of; "
                        "default rapidformer's: 256 under CUDA graphs, 64 eager)")
    p.add_argument("--arms", default=",".join(ALL_ARMS), help=f"comma list of {ALL_ARMS}")
    p.add_argument("--warmup", type=int, default=30, help="untimed steps (compilation happens here)")
    p.add_argument("--steps", type=int, default=100, help="timed steps")
    p.add_argument("--profile-steps", type=int, default=10, help="profiled steps after the timed ones (eager arms)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers of every arm")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="fp32 (for a CPU smoke test)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--out", default=None, help="logs and results (default $OUT, else /tmp/bench_finetune)")
    p.add_argument("--arm-timeout", type=int, default=400, help="seconds before an arm's subprocess is killed")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for all arms together: an arm gets what is left (arms in --arms order)")
    p.add_argument("--arm", help=argparse.SUPPRESS)      # child mode: run this one arm
    p.add_argument("--result", help=argparse.SUPPRESS)   # child mode: write its JSON here
    a = p.parse_args(argv)
    if a.tiny:
        a.warmup, a.steps, a.profile_steps = min(a.warmup, 5), min(a.steps, 10), min(a.profile_steps, 3)
        a.max_len = min(a.max_len, 64)
        a.dropout = False
    a.total_steps = a.warmup + a.steps + a.profile_steps + 1  # +1: the clock stops at the start of a step
    a.samples = a.total_steps * a.batch                          # one epoch, no sample seen twice
    return a


# ---- shared by every arm --------------------------------------------------------------------------------
def model_config(a):
    from transformers import BertConfig

    kw = dict(num_labels=2, attn_implementation="sdpa")
    if not a.dropout:
        kw.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if a.tiny:
        kw.update(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256)
    return BertConfig(**kw)


def build_model(a):
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(a.seed)  # identical weights in every arm
    model = BertForSequenceClassification(model_config(a))
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model


def build_dataset(a) -> List[Dict]:
    """Random sentence pairs: [CLS] a [SEP] b [SEP], lengths uniform in [min_len, max_len], labels 0/1."""
    import numpy as np
    import torch

    rng = np.random.default_rng(a.seed)
    vocab = model_config(a).vocab_size
    out = []
    for _ in range(a.samples):
        n = int(rng.integers(a.min_len, a.max_len + 1))
        first = int(rng.integers(1, n - 3))                # length of segment a (>= 1); b gets n - 3 - first >= 1
        ids = rng.integers(1000, vocab, size=n)
        ids[0], ids[first + 1], ids[n - 1] = CLS, SEP, SEP
        tt = np.zeros(n, dtype=np.int64)
        tt[first + 2:] = 1
        out.append({"input_ids": torch.from_numpy(ids.astype(np.int64)), "token_type_ids": torch.from_numpy(tt),
                    "labels": int(rng.integers(0, 2))})
    return out


class PadCollator:
    """Pads to the longest sample of the batch, rounded up to a multiple of `multiple` (what
    DataCollatorWithPadding does, without a tokenizer) and records each batch's longest sample (in the main
    process: --num-workers 0), which the fairness check compares between arms."""

    def __init__(self, multiple: int = 1) -> None:
        self.lengths: List[int] = []
        self.multiple = multiple

    def __call__(self, samples: List[Dict]):
        import torch

        longest = max(len(s["input_ids"]) for s in samples)
        n = -(-longest // self.multiple) * self.multiple
        ids = torch.full((len(samples), n), PAD, dtype=torch.long)
        tt = torch.zeros((len(samples), n), dtype=torch.long)
        mask = torch.zeros((len(samples), n), dtype=torch.long)
        for i, s in enumerate(samples):
            k = len(s["input_ids"])
            ids[i, :k], tt[i, :k], mask[i, :k] = s["input_ids"], s["token_type_ids"], 1
        self.lengths.append(longest)
        return {"input_ids": ids, "token_type_ids": tt, "attention_mask": mask,
                "labels": torch.tensor([s["labels"] for s in samples], dtype=torch.long)}


class Clock:
    """Called at the start of every forward step: synchronizes and reads the clock at step `warmup` and at
    step `warmup + steps`, then profiles the next `profile_steps` steps when asked."""

    def __init__(self, a, device, profile: bool) -> None:
        self.a, self.device, self.profile = a, device, profile
        self.k = 0
        self.t0 = self.t1 = self.t_mid = None
        self.seq: List[int] = []
        self.losses: List = []
        self.prof = None
        self.prof_wall = None
        self.peak = 0
        self.t_start = time.perf_counter()

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def tick(self, batch: Dict) -> None:
        """At the start of each forward step: the batch's tokens and attention pairs (padded: samples x length and
        samples x length^2; packed: the row's tokens and the sum of its segments' squared lengths)."""
        import torch

        a, k = self.a, self.k
        if k == a.warmup:
            self.sync()
            self.t0 = time.perf_counter()
            self.graphs0 = compiled_graphs()
        elif k == a.warmup + a.steps // 2 and a.steps >= 2:
            self.sync()  # one extra sync in the window: the halves show an arm still warming up
            self.t_mid = time.perf_counter()
        elif k == a.warmup + a.steps:
            self.sync()
            self.t1 = time.perf_counter()
            self.graphs_in_window = compiled_graphs() - self.graphs0
            if self.device.type == "cuda":
                self.peak = torch.cuda.max_memory_allocated(self.device)
            if self.profile and a.profile_steps:
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
                self.prof = profile(activities=acts)
                self.prof.__enter__()
                self.p0 = time.perf_counter()
        elif self.prof is not None and k == a.warmup + a.steps + a.profile_steps:
            self.sync()
            self.prof_wall = time.perf_counter() - self.p0
            self.prof.__exit__(None, None, None)
        self.seq.append(work(batch))
        self.k += 1

    def result(self, arm: str, model, collator: PadCollator, extra: Dict) -> Dict:
        import torch

        a = self.a
        cfg = model_config(a)
        L, h, ffn = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
        n_lin = L * (4 * h * h + 2 * h * ffn)
        timed = self.seq[a.warmup:a.warmup + a.steps]
        tokens = sum(t for t, _ in timed)
        flops = sum(6 * n_lin * t + 12 * L * h * pairs for t, pairs in timed)
        dt = self.t1 - self.t0
        losses = torch.stack([x.float() for x in self.losses[:a.warmup + a.steps]]).cpu().tolist()
        half = a.steps // 2
        halves = ([half * a.batch / (self.t_mid - self.t0), (a.steps - half) * a.batch / (self.t1 - self.t_mid)]
                  if self.t_mid else [])
        r = {"arm": arm, "seconds": dt, "samples_per_s": a.steps * a.batch / dt, "samples_per_s_halves": halves,
             "tokens_per_s": tokens / dt, "tflops": flops / dt / 1e12, "mean_padded_len": tokens / a.batch / a.steps,
             "peak_mem_gib": self.peak / 2**30,
             "final_loss": sum(losses[-10:]) / len(losses[-10:]), "first_loss": losses[0],
             "warmup_s": self.t0 - self.t_start, "graphs_compiled_in_window": self.graphs_in_window,
             "graphs_compiled": compiled_graphs(), "batch_lengths": collator.lengths[:a.total_steps],
             "losses": losses,
             "params": sum(p.numel() for p in model.parameters()), **extra}
        if self.prof is not None:
            r["profile"] = summarize_profile(self.prof, a.profile_steps, self.prof_wall)
        return r


def work(batch: Dict):
    """(tokens, attention pairs) a batch computes: padded [samples, length]; packed one row of segments."""
    ids = batch["input_ids"]
    if "cu_seq_lens" in batch:
        lengths = (batch["cu_seq_lens"][1:] - batch["cu_seq_lens"][:-1]).long()
        return int(ids.numel()), int((lengths * lengths).sum())
    n, length = ids.shape
    return n * length, n * length * length


def compiled_graphs() -> int:
    """Graphs torch.compile has built so far in this process (a recompile inside the timed window shows here)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def summarize_profile(prof, steps: int, wall: float) -> Dict:
    """GPU busy share, GPU time by kernel class, top kernels, top CPU operators and syncs, per step."""
    from torch.autograd import DeviceType

    classes = [("attention", ("fmha", "attention", "flash", "efficient", "mem_eff", "sdpa")),  # before gemm: cuDNN's
               ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "sm90_")),    # SDPA names hold sm90_
               ("optimizer", ("adam", "multi_tensor", "foreach", "norm_kernel", "l2norm")),
               ("layernorm", ("layer_norm",)), ("dropout/rng", ("dropout", "bernoulli", "philox")),
               ("softmax/loss", ("softmax", "nll", "cross_entropy")),
               ("copy/cast", ("copy", "memcpy", "memset", "to_copy", "cast")),
               ("reduce", ("reduce",)), ("elementwise", ("elementwise", "unrolled", "vectorized"))]
    by_class: Dict[str, float] = {}
    kernels: Dict[str, List[float]] = {}
    n_kernels, gpu_us = 0, 0.0
    cpu_sync_us, n_launch = 0.0, 0
    for e in prof.events():
        if getattr(e, "is_user_annotation", False):
            continue  # record_function ranges drawn on the GPU timeline (Optimizer.step#AdamW.step): no kernels
        if e.device_type == DeviceType.CUDA:
            us = e.time_range.elapsed_us()
            gpu_us += us
            n_kernels += 1
            name = e.name
            low = name.lower()
            cls = next((c for c, keys in classes if any(k in low for k in keys)), "other")
            by_class[cls] = by_class.get(cls, 0.0) + us
            kk = kernels.setdefault(name[:90], [0.0, 0])
            kk[0] += us
            kk[1] += 1
        else:
            if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
                cpu_sync_us += e.time_range.elapsed_us()
            elif e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
                n_launch += 1
    cpu_ops = []
    for e in prof.key_averages():
        if e.device_type == DeviceType.CPU and not e.key.startswith(("ProfilerStep", "cuda", "cu")):
            cpu_ops.append((e.self_cpu_time_total, e.count, e.key))
    cpu_ops.sort(reverse=True)
    per = 1e3 * steps
    return {"wall_ms_per_step": wall * 1e3 / steps, "gpu_ms_per_step": gpu_us / per,
            "gpu_busy": gpu_us / 1e6 / wall if wall else 0.0, "kernels_per_step": n_kernels / steps,
            "launches_per_step": n_launch / steps, "cpu_sync_wait_ms_per_step": cpu_sync_us / per,
            "gpu_ms_by_class": {k: v / per for k, v in sorted(by_class.items(), key=lambda x: -x[1])},
            "top_kernels": [(n, v[0] / per, v[1] / steps) for n, v in
                            sorted(kernels.items(), key=lambda x: -x[1][0])[:10]],
            "top_cpu_ops": [(k, t / per, c / steps) for t, c, k in cpu_ops[:12]]}


def optional_kwargs(cls, **kw) -> Dict:
    """The keyword arguments `cls` accepts (group_by_length and use_cpu come and go between transformers versions)."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in kw.items() if k in params}


def pick_device(a):
    import torch

    name = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# ---- arms -----------------------------------------------------------------------------------------------
def run_trainer(a, arm: str) -> Dict:
    import torch
    from transformers import Trainer, TrainingArguments
    import transformers

    device = pick_device(a)
    compile_, graphs = arm != "trainer", arm == "trainer_graphs"
    clock = Clock(a, device, profile=arm in PROFILED)
    collator = PadCollator(GRAPH_PAD if graphs else 1)
    ds = build_dataset(a)
    model = build_model(a)

    class TimedTrainer(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None, *args, **kw):
            clock.tick(inputs)
            loss = super().training_step(model, inputs, num_items_in_batch, *args, **kw)
            clock.losses.append(loss.detach().clone())  # a CUDA graph's output is overwritten by its next replay
            return loss

    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArguments(
            output_dir=tmp, max_steps=a.total_steps, per_device_train_batch_size=a.batch, learning_rate=a.lr,
            weight_decay=0.01, lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=1.0,
            adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
            bf16=a.bf16, optim="adamw_torch_fused", torch_compile=compile_,
            **({"torch_compile_mode": "reduce-overhead"} if graphs else {}),
            logging_strategy="steps", logging_steps=50, save_strategy="no", eval_strategy="no", report_to=[],
            seed=a.seed, data_seed=a.seed, dataloader_num_workers=a.num_workers, dataloader_pin_memory=True,
            disable_tqdm=True, **optional_kwargs(TrainingArguments, group_by_length=False,
                                                 use_cpu=device.type == "cpu"))
        trainer = TimedTrainer(model=model, args=targs, train_dataset=ds, data_collator=collator)
        trainer.train()
    extra = {"framework": f"transformers {transformers.__version__}", "torch": torch.__version__,
             "settings": f"Trainer bf16={a.bf16} adamw_torch_fused torch_compile={compile_}"
                         f"{' reduce-overhead pad64' if graphs else ''} sdpa "
                         f"logging_steps=50 workers={a.num_workers}",
             "optimizer": type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                               else trainer.optimizer).__name__}
    return clock.result(arm, model, collator, extra)


def run_rapidformer(a, arm: str) -> Dict:
    import torch
    from megatron_patch.config.rapidformer_flags import parse_args
    from megatron_patch.templates.rules import check
    from megatron_patch.templates import Finetuner, RapidformerEngine
    from megatron_patch.templates.globals import set_args

    # --seed is seed-1: Finetuner.train() sets the sampler's epoch to 1 (DistributedSampler seeds seed+epoch),
    # the Trainer's sampler starts at epoch 0, so both draw torch.randperm(n) from a generator seeded `seed`.
    # The model's weights come from `seed` in build_model either way.
    argv = ["--user-script", os.path.abspath(__file__), "--micro-batch-size", str(a.batch),
            "--train-iters", str(a.total_steps), "--lr", str(a.lr), "--seed", str(a.seed - 1),
            "--log-interval", "50", "--num-workers", str(a.num_workers), "--weight-decay", "0.01",
            "--clip-grad", "1.0", "--lr-decay-style", "linear", *(["--bf16"] if a.bf16 else []), *RF_FLAGS[arm],
            *(["--pad-to-multiple-of", str(a.packed_multiple)] if arm in PACKED and a.packed_multiple else [])]
    args = check(parse_args(argv), world_size=1)
    set_args(args)
    engine = RapidformerEngine(args)
    device = engine.device if a.device is None else torch.device(a.device)
    engine.device = device
    clock = Clock(a, device, profile=arm in PROFILED)
    collator = PadCollator(GRAPH_PAD if arm == "rf_graphs" else 1)
    ds = build_dataset(a)
    holder = {}

    class BenchFinetuner(Finetuner):
        def train_valid_test_datasets_provider(self):
            return ds, None, None, collator

        def model_optimizer_lr_scheduler_provider(self):
            holder["model"] = build_model(a)
            return holder["model"], None, None

        def run_forward_step(self, batch, model):
            clock.tick(batch)
            loss = model(**batch).loss
            clock.losses.append(loss.detach().clone())  # a CUDA graph's output is overwritten by its next replay
            return loss

        def run_compute_metrics(self, model, eval_dataloader):
            return {}

    ft = BenchFinetuner(engine)
    ft.train()
    extra = {"framework": "rapidformer", "torch": torch.__version__,
             "settings": " ".join(argv[2:]), "optimizer": "see log (acceleration: optimizer ...)"}
    return clock.result(arm, holder["model"], collator, extra)


def child(a) -> int:
    import torch

    if a.arm.startswith("trainer"):
        r = run_trainer(a, a.arm)
    else:
        r = run_rapidformer(a, a.arm)
    r["device_name"] = torch.cuda.get_device_name() if torch.cuda.is_available() and a.device != "cpu" else "cpu"
    with open(a.result, "w") as f:
        json.dump(r, f, indent=1)
    prof = r.pop("profile", None)
    r.pop("batch_lengths")
    r.pop("losses")
    print("RESULT", json.dumps(r))
    if prof:
        print_profile(a.arm, prof)
    return 0


def print_profile(arm: str, p: Dict, file=sys.stdout) -> None:
    print(f"--- where the time goes: {arm}, torch.profiler over the profiled steps (per step) ---", file=file)
    print(f"wall {p['wall_ms_per_step']:.1f} ms (profiler on) | GPU kernels {p['gpu_ms_per_step']:.1f} ms "
          f"(GPU busy {100 * p['gpu_busy']:.0f}%) | {p['kernels_per_step']:.0f} kernels, "
          f"{p['launches_per_step']:.0f} launches | CPU blocked in syncs {p['cpu_sync_wait_ms_per_step']:.1f} ms",
          file=file)
    print("GPU ms by class: " + ", ".join(f"{k} {v:.2f}" for k, v in p["gpu_ms_by_class"].items()), file=file)
    print("top kernels (ms/step, calls/step):", file=file)
    for n, ms, c in p["top_kernels"]:
        print(f"  {ms:7.2f} {c:5.0f}  {n}", file=file)
    print("top CPU ops by self CPU time (ms/step, calls/step):", file=file)
    for n, ms, c in p["top_cpu_ops"]:
        print(f"  {ms:7.2f} {c:5.0f}  {n}", file=file)


# ---- parent -------------------------------------------------------------------------------------------
def main(argv: Optional[List[str]] = None) -> int:
    a = parse(argv)
    if a.arm:
        return child(a)
    out = a.out or os.environ.get("OUT") or "/tmp/bench_finetune"
    os.makedirs(out, exist_ok=True)
    arms = [x for x in a.arms.split(",") if x]
    bad = [x for x in arms if x not in ALL_ARMS]
    if bad:
        raise SystemExit(f"unknown arm(s) {bad}; choose from {ALL_ARMS}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    passthrough = [x for x in (argv if argv is not None else sys.argv[1:])]
    results: Dict[str, Dict] = {}
    deadline = time.perf_counter() + a.time_budget if a.time_budget else None
    for arm in arms:
        limit = a.arm_timeout
        if deadline is not None:
            limit = min(limit, deadline - time.perf_counter())
            if limit < 20:
                results[arm] = {"arm": arm, "error": "not run: --time-budget spent", "process_s": 0.0}
                print(f"[bench_finetune] {arm}: skipped, --time-budget spent", flush=True)
                continue
        res, log = os.path.join(out, f"{arm}.json"), os.path.join(out, f"{arm}.log")
        cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--arm", arm, "--result", res]
        t = time.perf_counter()
        print(f"[bench_finetune] {arm} ...", flush=True)
        try:
            with open(log, "w") as f:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                    timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {limit:.0f} s"
        wall = time.perf_counter() - t
        if rc == 0 and os.path.exists(res):
            with open(res) as f:
                results[arm] = json.load(f)
            results[arm]["process_s"] = wall
            r = results[arm]
            print(f"[bench_finetune] {arm}: {r['samples_per_s']:.1f} samples/s, process {wall:.0f} s", flush=True)
        else:
            with open(log) as f:
                tail = f.read()[-3000:]
            results[arm] = {"arm": arm, "error": f"rc={rc}", "process_s": wall}
            print(f"[bench_finetune] {arm} FAILED ({rc}); log tail:\n{tail}", flush=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(results, f, indent=1)
    report = table(a, results)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(report + "\n")
    print(report)
    return 0 if all("error" not in r for r in results.values()) else 1


def table(a, results: Dict[str, Dict]) -> str:
    ok = {k: r for k, r in results.items() if "error" not in r}
    lines = []
    if ok:
        any_r = next(iter(ok.values()))
        lines.append(f"\n{any_r.get('device_name')} | {any_r.get('framework', '')} / torch {any_r.get('torch')} | "
                     f"params {any_r['params'] / 1e6:.1f}M | batch {a.batch}, lengths {a.min_len}-{a.max_len}, "
                     f"dynamic padding | {a.warmup} warm-up + {a.steps} timed steps | bf16={a.bf16}")
    # where the time goes (eager arms)
    for k in PROFILED:
        if k in ok and "profile" in ok[k]:
            import io

            buf = io.StringIO()
            print_profile(k, ok[k]["profile"], file=buf)
            lines.append(buf.getvalue().rstrip())
    # same batches?
    ref = ok.get("trainer") or ok.get("trainer_compile")
    trainer_best = max([ok[k]["samples_per_s"] for k in ("trainer", "trainer_compile") if k in ok] or [0.0])
    lines.append("")
    lines.append("| arm | samples/s | 1st / 2nd half | x Trainer best | tokens/s (padded) | TFLOP/s | peak mem GiB | "
                 "final loss (last 10) | warm-up s | graphs compiled (in window) | same batches as trainer |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for arm, r in results.items():
        if "error" in r:
            lines.append(f"| {arm} | FAILED ({r['error']}) | | | | | | | | | |")
            continue
        same = "-" if ref is None or r is ref else ("yes" if r["batch_lengths"] == ref["batch_lengths"] else "NO")
        ratio = f"{r['samples_per_s'] / trainer_best:.2f}x" if trainer_best else "-"
        halves = " / ".join(f"{x:.0f}" for x in r.get("samples_per_s_halves", [])) or "-"
        lines.append(f"| {arm} | {r['samples_per_s']:.1f} | {halves} | {ratio} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tflops']:.1f} | "
                     f"{r['peak_mem_gib']:.2f} | {r['final_loss']:.4f} | {r['warmup_s']:.1f} | "
                     f"{r['graphs_compiled']} ({r['graphs_compiled_in_window']}) | {same} |")
    if "rf_graphs" in ok and "trainer_graphs" in ok:
        lines.append(f"\nwith the same CUDA-graph setting on both sides: rf_graphs / trainer_graphs = "
                     f"{ok['rf_graphs']['samples_per_s'] / ok['trainer_graphs']['samples_per_s']:.2f}x")
    for arm in PACKED:
        if arm in ok and "rf" in ok:
            mine, ref_losses = ok[arm]["losses"], ok["rf"]["losses"]
            diff = max(abs(x - y) for x, y in zip(mine, ref_losses))
            lines.append(f"\n{arm} vs rf, per-step losses of the {len(mine)} steps: max |difference| {diff:.2e} "
                         f"({'dropout off: equal up to rounding' if not a.dropout else 'dropout on: other masks'})")
    if ok:
        lens = [r["mean_padded_len"] for r in ok.values()]
        lines.append(f"\nmean padded length of the timed batches: {min(lens):.1f}-{max(lens):.1f} tokens per sample "
                     f"(packed arms: row tokens / samples); TFLOP/s counts the computed tokens x 6 x encoder linear "
                     f"weights + 12 x L x h x attention pairs (padded: s^2 per sample; packed: each segment's)")
    return "\n".join(lines)


if __name__ == "__main__":
    # Under `rapidformer --user-script` this file would be run again by the worker: nothing to do then, the
    # benchmark builds its Finetuner itself (the flag only satisfies the front end's rules).
    sys.exit(main())
