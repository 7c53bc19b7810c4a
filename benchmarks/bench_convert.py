"""Checkpoint conversion at scale on this machine: wall time and peak host memory of
`tools/convert_checkpoint.py` on a ~1B-parameter Llama (random weights).

Steps, each one command run as a user runs it, measured separately:
  anchor            transformers' own AutoModelForCausalLM.from_pretrained + save_pretrained of the same
                    directory (the ratios are against it)
  create            a Hugging Face LlamaForCausalLM directory (config.json + safetensors shards), written
                    tensor by tensor with megatron_patch's HFCheckpointWriter (no model object in memory)
  hf2mcore TP1      --direction hf2mcore, target TP1 PP1
  hf2mcore TP1 +v   the same with --verify (the verify phase is also reported on its own)
  hf2mcore TP2      target TP2 PP1 (two worker processes)
  mcore2hf          --direction mcore2hf of the TP1 checkpoint
  mcore2hf +v       the same with --verify

Memory: every 0.2 s the whole process tree of the command (the tool, torchrun, its workers and the
checkpoint writer's forked helpers) is read from /proc/PID/smaps_rollup: `Pss` (resident pages, each
shared page divided among the processes that map it, so a fork's copy-on-write pages and a mmapped
safetensors file count once; includes file pages the kernel can drop) and `Pss_Anon` (anonymous
memory: what the processes really hold). Peaks are of the sums over the tree. A phase ("worker hf2mcore",
"worker verify", or "tool" when no worker is alive) is told by the workers' command lines.

    python benchmarks/bench_convert.py [--layers 18] [--dtype bf16] [--skip-tp2] [--keep] [--workdir DIR]
    python benchmarks/bench_convert.py --llama3-8b     # Llama-3-8B's shape and RoPE scaling, the 1-copy check

--llama3-8b: 32 layers, hidden 4096, ffn 14336, 32 heads / 8 KV heads, vocab 128256, rope_type llama3 (8.03B
parameters, 14.96 GiB in bf16); without the TP2 and --verify steps (fp32 twice would not fit 24 GiB), and the
Hugging Face source is removed once converted (three copies would not fit this machine's free disk).

The default shape is the DESIGN's Llama 1.3B one (hidden 2048, ffn 5504, 16 heads, vocab 32000) with
18 layers instead of 24: 1.04B parameters (--layers 24 gives 1.345B). Temporary files are removed at
the end unless --keep.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30


# ------------------------------------------------------------------------------------- the model

def llama_config(a) -> Dict:
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if a.llama3_8b:
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                       num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=2048,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, dtype={"bf16": "bfloat16", "fp32": "float32"}[a.dtype],
                       rope_parameters=rope, architectures=["LlamaForCausalLM"]).to_dict()


def tensor_shapes(a) -> List:
    h, f, v, d = a.hidden, a.ffn, a.vocab, a.hidden // a.heads
    shapes = [("model.embed_tokens.weight", (v, h))]
    for i in range(a.layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (a.heads * d, h)),
                   (p + "self_attn.k_proj.weight", (a.kv_heads * d, h)), (p + "self_attn.v_proj.weight", (a.kv_heads * d, h)),
                   (p + "self_attn.o_proj.weight", (h, a.heads * d)), (p + "post_attention_layernorm.weight", (h,)),
                   (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                   (p + "mlp.down_proj.weight", (h, f))]
    return shapes + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def create(a, out: str) -> None:
    """The Hugging Face directory, one random tensor at a time (memory: one 1 GB shard at most)."""
    import torch

    from megatron_patch.conversion.hf_io import HFCheckpointWriter

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    torch.manual_seed(0)
    with HFCheckpointWriter(out, max_shard_bytes=10**9) as w:
        for name, shape in tensor_shapes(a):
            if len(shape) == 1:  # norms: near 1
                t = 1 + 0.1 * torch.randn(shape, dtype=torch.float32)
            else:
                t = 0.02 * torch.randn(shape, dtype=torch.float32)
            w.add(name, t.to(dtype))
            del t
        w.close({"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(llama_config(a), f, indent=2, sort_keys=True)


def num_params(a) -> int:
    n = 0
    for _, shape in tensor_shapes(a):
        k = 1
        for s in shape:
            k *= s
        n += k
    return n


# ------------------------------------------------------------------------------------- measuring

def _status(pid: int) -> Optional[Dict[str, int]]:
    """Proportional set sizes of a process (/proc/PID/smaps_rollup): pages shared with other processes
    (a fork's copy-on-write pages, one mmapped file) count once over the tree, not once per process."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line and not line[0].isdigit())
        return {"Pss": int(fields["Pss"].split()[0]) * 1024, "PssAnon": int(fields["Pss_Anon"].split()[0]) * 1024}
    except (OSError, ValueError, KeyError):
        return None


def _phase(cmdlines: List[List[str]]) -> str:
    for cmd in cmdlines:
        if "megatron_patch.conversion.worker" in cmd:
            i = cmd.index("megatron_patch.conversion.worker")
            if i + 1 < len(cmd) and cmd[i + 1] in ("hf2mcore", "verify"):
                return "worker " + cmd[i + 1]
    return "tool"


class TreeMonitor(threading.Thread):
    """Samples the resident memory of a process and all its descendants every `interval` seconds."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.stop = threading.Event()
        self.peak: Dict[str, Dict[str, int]] = {}  # phase -> {"Pss": bytes, "PssAnon": bytes, "procs": n}
        self.phase_time: Dict[str, float] = {}

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        last = time.perf_counter()
        while not self.stop.is_set():
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                break
            total = {"Pss": 0, "PssAnon": 0}
            cmdlines = []
            for p in procs:
                s = _status(p.pid)
                if s:
                    total["Pss"] += s.get("Pss", 0)
                    total["PssAnon"] += s.get("PssAnon", 0)
                try:
                    cmdlines.append(p.cmdline())
                except psutil.Error:
                    pass
            phase = _phase(cmdlines)
            now = time.perf_counter()
            self.phase_time[phase] = self.phase_time.get(phase, 0.0) + (now - last)
            last = now
            for key in (phase, "all"):
                peak = self.peak.setdefault(key, {"Pss": 0, "PssAnon": 0, "procs": 0})
                for k in ("Pss", "PssAnon"):
                    peak[k] = max(peak[k], total[k])
                peak["procs"] = max(peak["procs"], len(procs))
            self.stop.wait(self.interval)


def measure(name: str, cmd: List[str], log: str) -> Dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        mon = TreeMonitor(proc.pid)
        mon.start()
        rc = proc.wait()
        mon.stop.set()
        mon.join()
    seconds = time.perf_counter() - t0
    if rc != 0:
        sys.exit(f"{name} failed ({rc}): {' '.join(cmd)}\n" + open(log).read()[-4000:])
    result = {"name": name, "seconds": seconds, "peak": mon.peak, "phase_seconds": mon.phase_time, "log": log}
    verdict = [line for line in open(log) if line.startswith("verify ")]
    if verdict:
        result["verify"] = verdict[-1].strip()
    print(f"  {name}: {seconds:.1f} s, peak PSS {mon.peak['all']['Pss'] / GiB:.2f} GiB "
          f"(anonymous {mon.peak['all']['PssAnon'] / GiB:.2f} GiB)", flush=True)
    return result


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


# ------------------------------------------------------------------------------------- main

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5504)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="dtype of the Hugging Face weights")
    p.add_argument("--skip-tp2", action="store_true", help="leave out hf2mcore at TP2")
    p.add_argument("--skip-verify", action="store_true", help="leave out the --verify runs")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--workdir", help="where to write (default: a new temporary directory)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--llama3-8b", action="store_true", help="Llama-3-8B's shape (module docstring)")
    p.add_argument("--_create", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.llama3_8b:
        a.layers, a.hidden, a.ffn, a.heads, a.kv_heads, a.vocab = 32, 4096, 14336, 32, 8, 128256
        a.skip_tp2 = a.skip_verify = True
    if a._create:
        create(a, a._create)
        return

    work = a.workdir or tempfile.mkdtemp(prefix="bench_convert_")
    os.makedirs(work, exist_ok=True)
    n = num_params(a)
    size = n * {"bf16": 2, "fp32": 4}[a.dtype]
    print(f"Llama {a.layers} layers, hidden {a.hidden}, ffn {a.ffn}, heads {a.heads}/{a.kv_heads}, vocab {a.vocab}: "
          f"{n / 1e9:.3f}B parameters, {size / GiB:.2f} GiB in {a.dtype} (fp32: {n * 4 / GiB:.2f} GiB); in {work}",
          flush=True)
    tool = [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py")]
    shape = ["--layers", str(a.layers), "--hidden", str(a.hidden), "--ffn", str(a.ffn), "--heads", str(a.heads),
             "--kv-heads", str(a.kv_heads), "--vocab", str(a.vocab), "--dtype", a.dtype,
             *(["--llama3-8b"] if a.llama3_8b else [])]
    hf, logs = os.path.join(work, "hf"), os.path.join(work, "logs")
    os.makedirs(logs, exist_ok=True)
    results = []
    try:
        results.append(measure("create (HF safetensors)", [sys.executable, os.path.abspath(__file__), *shape,
                                                           "--_create", hf], os.path.join(logs, "create.log")))
        # the anchor: what transformers itself needs to read this model and write it back
        anchor = ("import sys, torch, transformers; m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], "
                  "dtype='auto'); m.save_pretrained(sys.argv[2])")
        r = measure("anchor: transformers from_pretrained + save_pretrained",
                    [sys.executable, "-c", anchor, hf, os.path.join(work, "hf_anchor")], os.path.join(logs, "anchor.log"))
        r["output_bytes"] = du(os.path.join(work, "hf_anchor"))
        shutil.rmtree(os.path.join(work, "hf_anchor"))
        results.append(r)
        steps = [("hf2mcore TP1 PP1", ["--direction", "hf2mcore", "--load-dir", hf, "--save-dir", "ck_tp1"])]
        if not a.skip_verify:
            steps.append(("hf2mcore TP1 PP1 --verify",
                          ["--direction", "hf2mcore", "--load-dir", hf, "--save-dir", "ck_tp1v", "--verify"]))
        if not a.skip_tp2:
            steps.append(("hf2mcore TP2 PP1", ["--direction", "hf2mcore", "--load-dir", hf, "--save-dir", "ck_tp2",
                                               "--target-tensor-model-parallel-size", "2"]))
        steps.append(("mcore2hf (from TP1)", ["--direction", "mcore2hf", "--load-dir", "ck_tp1", "--save-dir", "hf_out",
                                              "--no-verify"]))
        if not a.skip_verify:
            steps.append(("mcore2hf (from TP1) --verify",
                          ["--direction", "mcore2hf", "--load-dir", "ck_tp1", "--save-dir", "hf_outv", "--verify"]))
        for name, args in steps:
            if a.llama3_8b and args[1] == "mcore2hf":  # disk: the source is read by no later step
                shutil.rmtree(hf, ignore_errors=True)
            args = [os.path.join(work, x) if x.startswith(("ck_", "hf_")) else x for x in args]
            r = measure(name, tool + args, os.path.join(logs, name.replace(" ", "_").replace("-", "") + ".log"))
            out = args[args.index("--save-dir") + 1]
            r["output_bytes"] = du(out)
            results.append(r)
            if os.path.basename(out) != "ck_tp1":  # disk: only the TP1 checkpoint is read later
                shutil.rmtree(out)
        report(a, n, size, results)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"params": n, "model_bytes": size, "results": results}, f, indent=1)
    finally:
        if a.keep:
            print(f"kept {work}")
        elif not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
        else:
            for name in ("hf", "ck_tp1", "ck_tp1v", "ck_tp2", "hf_out", "hf_outv"):
                shutil.rmtree(os.path.join(work, name), ignore_errors=True)


def report(a, n: int, size: int, results: List[Dict]) -> None:
    g = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    print(f"\n{n / 1e9:.3f}B-parameter Llama ({a.layers} layers, hidden {a.hidden}, ffn {a.ffn}, vocab {a.vocab}), "
          f"{a.dtype} weights = {g(size)} GiB (fp32 copy {g(n * 4)} GiB); {os.cpu_count()} CPU cores\n")
    base = next((r for r in results if r["name"].startswith("anchor")), None)
    print("| step | wall s | x anchor | peak PSS GiB (tree) | peak anonymous PSS GiB | x anchor | peak anon / model size "
          "| output GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        pk = r["peak"]["all"]
        ratio_t = f"{r['seconds'] / base['seconds']:.2f}" if base else "-"
        ratio_m = f"{pk['PssAnon'] / base['peak']['all']['PssAnon']:.2f}" if base else "-"
        print(f"| {r['name']} | {r['seconds']:.1f} | {ratio_t} | {g(pk['Pss'])} | {g(pk['PssAnon'])} | {ratio_m} | "
              f"{pk['PssAnon'] / size:.2f} | {g(r.get('output_bytes', 0)) if 'output_bytes' in r else '-'} |")
    print("\nby phase (peak PSS / peak anonymous PSS GiB, seconds):")
    for r in results:
        phases = [f"{ph}: {g(v['Pss'])} / {g(v['PssAnon'])}, {r['phase_seconds'].get(ph, 0):.0f} s"
                  for ph, v in r["peak"].items() if ph != "all"]
        print(f"  {r['name']}: " + "; ".join(phases) + (f"  [{r['verify']}]" if "verify" in r else ""))


if __name__ == "__main__":
    main()
