"""`tools/convert_checkpoint.py`: Hugging Face <-> engine checkpoints, both directions, any TP/PP.

  hf2mcore  a Hugging Face directory -> an engine checkpoint (iteration 0, weights only) that
            `pretrain_megatron_gpt.py --load DIR` continues from, its model arguments stored with it.
            The model is built in the target layout by TP x PP worker processes (started here, CPU,
            gloo), each loading only its slice, one tensor at a time. A mixture-of-experts model
            (Mixtral, Qwen2-MoE) also takes an expert layout (EP, ETP): then PP x lcm(TP, EP x ETP)
            processes, the experts carved out of data parallelism as in training.
  mcore2hf  any engine checkpoint (any TP/PP/VPP, ZeRO-0/1/2) -> config.json + safetensors (sharded
            above --max-shard-size) + tokenizer files, loadable with AutoModelForCausalLM.from_pretrained
            (BERT: BertForPreTraining / BertForMaskedLM).

`--verify` runs both models on the same token batches and fails (exit 3) unless the logits agree (see
verify.py; BERT: hidden states and heads, verify_bert.py). mcore2hf verifies by default, whatever the
checkpoint's origin (trained in the engine, converted, or trained after a conversion): an export is what
leaves the engine, so it is proved unless `--no-verify` says otherwise (e.g. a model too large to hold twice
in fp32). hf2mcore verifies on request (`--verify`). The rule: what leaves the engine is proved by default;
an import has every tensor checked for use and shape as it loads, and the model trained from it is proved
when it is exported, so by default it does not pay for a second model in fp32. Verify's engine model is loaded
by the engine's own checkpoint loading (the resume path), never by the reader the export read (mcore_reader.py):
a reader bug makes the two models differ instead of being repeated on both sides (worker.py).

Both directions stage (publish()): the workers write into a hidden `.<name>.partial-*` directory next to
--save-dir, --verify reads it there, and it is renamed to --save-dir only once complete and verified. A
conversion error, a failed verify or Ctrl-C removes it: nothing is left at --save-dir. hf2mcore's stored
configuration (checkpoint.json "config": `save`) names --save-dir, not the staging directory.

mcore2hf describes the model that was built, not the arguments as given: dimensions a run left at their
defaults (stored as None) are derived by the engine's own model builder (architecture.py), and the written
tensors are checked against a transformers model of the exported config.json before anything is published.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

from megatron_patch.ports import free_port

if TYPE_CHECKING:
    from .family import Family

ROOT_HELP = "Convert checkpoints between Hugging Face and the engine (megatron-core), both ways, any TP/PP."
STAGING_INFIX = ".partial-"  # .<name>.partial-XXXX next to --save-dir: a conversion being written
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=ROOT_HELP)
    p.add_argument("--direction", required=True, choices=["hf2mcore", "mcore2hf"])
    p.add_argument("--load-dir", required=True, help="source: a Hugging Face directory, or an engine checkpoint "
                   "(a --save directory or one iter_XXXXXXX in it)")
    p.add_argument("--save-dir", required=True, help="destination directory (must be empty or absent)")
    p.add_argument("--model-family", default="auto", choices=["auto", *family_names()],
                   help="auto: config.json's model_type (hf2mcore) or the checkpoint's family (mcore2hf)")
    p.add_argument("--target-tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--target-expert-model-parallel-size", type=int, default=1,
                   help="mixture of experts (hf2mcore): EP ranks, each holding num_experts / EP of every layer's experts")
    p.add_argument("--target-expert-tensor-parallel-size", type=int,
                   help="mixture of experts (hf2mcore): the experts' tensor parallelism (default: TP)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="the embedding is padded to a multiple of lcm(this, TP) rows (hf2mcore)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="mcore2hf: tensor dtype written (auto: the original Hugging Face dtype when the checkpoint "
                        "came from one, else the checkpoint's)")
    p.add_argument("--max-shard-size", default="5GB", help="mcore2hf: safetensors shard size (e.g. 500MB, 5GB)")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                   help="compare the logits of both models; exit 3 if they differ (default: on for mcore2hf, off "
                        "for hf2mcore; --no-verify turns it off)")
    p.add_argument("--debug", action="store_true", help="with --verify, print the difference after every layer")
    p.add_argument("--lora-format", choices=["merged", "peft"], default="merged",
                   help="mcore2hf of a LoRA checkpoint: the adapters merged into the weights (a whole model), or a "
                        "PEFT adapter directory for the base model the run started from (peft.PeftModel.from_pretrained)")
    a = p.parse_args(argv)
    if a.verify is None:
        a.verify = a.direction == "mcore2hf"  # an export is proved by default (module docstring)
    return a


def family_names() -> List[str]:
    """What --model-family accepts besides auto: every registered family's model_types and engine names."""
    from .tables import FAMILIES

    return sorted({*FAMILIES.model_types(), *FAMILIES.engine_families()})


def _bytes(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    for u, n in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(u):
            return int(float(t[: -len(u)]) * n)
    return int(t)


def _check_save_dir(path: str) -> None:
    from .mapping import ConversionError  # exit 2 with "conversion error: ...", as every refusal

    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConversionError(f"--save-dir {path} exists and is not empty; choose a new or empty directory "
                              f"(nothing is overwritten)")


def _family_check(asked: str, found: str) -> None:
    from .mapping import ConversionError

    alias = {"gpt2": "gpt", "gpt": "gpt"}
    if asked != "auto" and alias.get(asked, asked) != alias.get(found, found):
        raise ConversionError(f"--model-family {asked}, but the checkpoint is a {found} model; pass "
                              f"--model-family auto or {found}")


def run_workers(nproc: int, task_args: List[str]) -> int:
    """Start `nproc` worker processes on the CPU (gloo); their log streams through. Returns the workers' exit
    status (0 ok, 2 conversion error, 3 verification failed), which each worker writes to a result file
    of its own (result.py); a worker that died without one is reported with torchrun's log."""
    from .result import BAD_INPUT, FAILED_VERIFY, OK, read_results

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc))))
    with tempfile.TemporaryDirectory(prefix="convert_status_") as status_dir, tempfile.TemporaryFile("w+") as err:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(free_port()), "-m", "megatron_patch.conversion.worker", *task_args, "--status-dir", status_dir]
        proc = subprocess.run(cmd, env=env, stderr=err, text=True)
        reports = read_results(status_dir)
        codes = {r.status for r in reports}
        if BAD_INPUT in codes:  # a refusal: the same message from several ranks is shown once
            messages = [r.message for r in reports if r.status == BAD_INPUT]
            print("\n".join(f"conversion error: {m}" for m in dict.fromkeys(messages)), file=sys.stderr)
            return BAD_INPUT
        if FAILED_VERIFY in codes:  # the verdict is on stdout already; torchrun's traceback would only hide it
            print("verification failed: the two models' logits differ (the verdict above), so the converted weights "
                  "do not reproduce the model. Rerun with --debug to see the first layer whose output differs, then "
                  "check that layer's rules in the family's table (QKV grouping, rotary layout, Conv1D transposes)",
                  file=sys.stderr)
            return FAILED_VERIFY
        if proc.returncode != 0 or len(reports) < nproc:  # a worker died without saying why: show its log
            err.seek(0)
            log = err.read()
            print(log[-6000:], file=sys.stderr)
            if "Signal 9 (SIGKILL)" in log:  # the kernel's out-of-memory killer, most often
                verifying = task_args[:1] == ["verify"]
                print("conversion error: a worker was killed (SIGKILL), most likely out of host memory"
                      + (": --verify holds the Hugging Face model and the converted one in fp32 at once; convert with "
                         "--no-verify on this machine, or verify where memory allows" if verifying else
                         ": the conversion holds about one copy of the model plus one tensor; free memory or use a "
                         "larger machine"), file=sys.stderr)
            return proc.returncode or 1
    return OK


def hf2mcore(a: argparse.Namespace) -> int:
    from . import tables
    from .hf_io import HFCheckpointReader, read_hf_config
    from .mapping import ConversionError

    config = read_hf_config(a.load_dir)
    _family_check(a.model_family, config.get("model_type", "?"))
    _check_save_dir(a.save_dir)
    try:  # the family and the engine model of config.json, refused here (before any worker) if not supported
        tables.for_model_type(config.get("model_type", "")).engine_args(config)
    except ConversionError as e:
        raise ConversionError(f"{a.load_dir}: {e}") from None
    reader = HFCheckpointReader(a.load_dir)
    reader.check_files()  # a truncated or corrupt shard is named here, before any worker starts
    first = next(iter(reader.keys()))
    hf_dtype = str(reader.dtype_of(first)).replace("torch.", "")
    tp, pp = a.target_tensor_model_parallel_size, a.target_pipeline_model_parallel_size
    ep, etp = a.target_expert_model_parallel_size, a.target_expert_tensor_parallel_size
    nproc = pp * math.lcm(tp, ep * (etp or tp))  # TP x PP x DP, with EP x ETP dividing TP x DP
    experts = f" EP {ep} ETP {etp or tp}" if ep > 1 or etp else ""
    print(f"hf2mcore: {a.load_dir} ({config.get('model_type')}, {hf_dtype}) -> {a.save_dir} at TP {tp} PP {pp}"
          f"{experts}, {nproc} worker process(es)", flush=True)
    layout = ["--tp", str(tp), "--pp", str(pp), "--ep", str(ep)] + (["--etp", str(etp)] if etp else [])

    def convert(staging: str) -> int:
        status = run_workers(nproc, ["hf2mcore", "--load-dir", a.load_dir, "--save-dir", staging,
                                     "--publish-dir", a.save_dir, *layout,
                                     "--make-vocab-size-divisible-by", str(a.make_vocab_size_divisible_by),
                                     "--hf-dtype", hf_dtype])
        if status or not a.verify:
            return status
        # The written checkpoint, read back in the target layout, against the Hugging Face model.
        return run_workers(nproc, ["verify", "--load-dir", staging, "--hf-dir", a.load_dir, *layout]
                           + (["--debug"] if a.debug else []))

    return publish(a.save_dir, "hf2mcore", convert, a.verify)


def _export_tokenizer(cfg: dict, model_info: dict, save_dir: str) -> List[str]:
    """Tokenizer files for the exported model: the Hugging Face source's, or made from the engine's."""
    import shutil

    from .hf_io import copy_aux_files

    for src in (cfg.get("load_hf"), cfg.get("tokenizer_model")):
        if src and os.path.isdir(src):
            return copy_aux_files(src, save_dir)
    if cfg.get("tokenizer_type") == "GPT2BPETokenizer" and cfg.get("vocab_file") and cfg.get("merge_file"):
        shutil.copyfile(cfg["vocab_file"], os.path.join(save_dir, "vocab.json"))
        shutil.copyfile(cfg["merge_file"], os.path.join(save_dir, "merges.txt"))
        with open(os.path.join(save_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                       "unk_token": "<|endoftext|>", "model_max_length": cfg.get("seq_length")}, f, indent=1)
        return ["vocab.json", "merges.txt", "tokenizer_config.json"]
    return []


def _end_of_document(cfg, vocab: int) -> Optional[int]:
    """The engine tokenizer's end-of-document id, which config.json names as bos/eos so that generate()
    stops where the engine's documents end; None where the tokenizer cannot be built here."""
    from megatron_patch.training.data import tokenizer_from_config

    try:
        eod = tokenizer_from_config(cfg).eod
    except Exception as e:  # noqa: BLE001  (the files may be gone: the export stays usable without them)
        print(f"mcore2hf: the run's tokenizer is not available ({e}); config.json names no bos/eos token", flush=True)
        return None
    return eod if eod is not None and 0 <= eod < vocab else None


def _staging_dir(save_dir: str) -> str:
    """A new hidden directory next to `save_dir` (same file system: the final rename is atomic)."""
    parent, name = os.path.split(os.path.abspath(save_dir))
    os.makedirs(parent, exist_ok=True)
    path = tempfile.mkdtemp(prefix=f".{name}{STAGING_INFIX}", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)  # mkdtemp's 0700 would stay with the published directory
    return path


def publish(save_dir: str, direction: str, write: Callable[[str], int], verified: bool) -> int:
    """Run `write(staging)`, which fills a new staging directory next to `save_dir` and returns an exit status
    (0 ok, 2 conversion error, 3 verification failed); on 0 the staging directory is renamed to `save_dir`
    (an empty one is replaced). Otherwise, or when `write` raises (Ctrl-C included), the staging directory is
    removed: `save_dir` is then as it was before, absent or empty."""
    import shutil

    staging = _staging_dir(save_dir)
    status, why = None, "the conversion failed"
    try:
        status = write(staging)
        if status == 0:
            os.replace(staging, save_dir)  # a non-empty --save-dir was refused before anything was written
    except KeyboardInterrupt:
        why = "interrupted"
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when published
        if status != 0:
            why = "it failed verification" if status == 3 else why
            print(f"{direction}: nothing written to {save_dir} ({why})", flush=True)
    if status:
        return status
    unverified = " (not verified: --no-verify)" if direction == "mcore2hf" else " (not verified: see --verify)"
    print(f"saved {save_dir}" + ("" if verified else unverified), flush=True)
    return 0


def mcore2hf(a: argparse.Namespace) -> int:
    from megatron_patch.config import Config

    from . import tables
    from .architecture import resolve
    from .mapping import ConversionError
    from .mcore_reader import MegatronCheckpointReader

    reader = MegatronCheckpointReader(a.load_dir)
    stored = reader.config
    cfg = Config.from_flat(stored)
    family = tables.for_engine(cfg)
    _family_check(a.model_family, cfg.model_family or family.name)
    _check_save_dir(a.save_dir)
    cfg = resolve(cfg)  # the dimensions of the model that was built, defaults included
    info = reader.manifest.get("model", {})
    rules = family.table.rules_for(cfg)
    if a.lora_format == "peft" and not cfg.lora_rank:
        raise ConversionError(f"{a.load_dir}: --lora-format peft exports LoRA adapters; this checkpoint has none "
                              f"(its run had no --lora-rank)")
    if cfg.lora_rank and a.lora_format == "peft":
        return publish(a.save_dir, "mcore2hf", lambda staging: _export_peft(a, reader, cfg, info, rules, staging),
                       a.verify)
    if cfg.lora_rank:  # the adapters merged into their weights: a whole model
        from .lora_export import MergedLoRAReader

        print(f"mcore2hf: LoRA rank {cfg.lora_rank} (alpha {cfg.lora_alpha:g}) merged into the weights", flush=True)
        reader = MergedLoRAReader(reader, cfg)
    have, need = set(reader.keys()), {r.mcore for r in rules}
    if have != need:
        extra, missing = sorted(have - need), sorted(need - have)
        raise ConversionError(f"{a.load_dir}: the {family.name} table "
                              + (f"needs {', '.join(missing[:3])}, which the checkpoint lacks" if missing else
                                 f"does not use {', '.join(extra[:3])}: converting would drop them"))

    def export(staging: str) -> int:
        name = _write_export(a, reader, cfg, family, info, rules, staging)
        if not a.verify:
            return 0
        nproc, layout = verify_layout(reader.manifest)
        return run_workers(nproc, ["verify", "--load-dir", a.load_dir, "--hf-dir", staging, "--dtype", DTYPES[name],
                                   *layout] + (["--debug"] if a.debug else []))

    return publish(a.save_dir, "mcore2hf", export, a.verify)


def verify_layout(manifest: dict) -> Tuple[int, List[str]]:
    """(processes, the worker's layout flags) mcore2hf verifies an export at: one process (TP1 PP1), which the engine
    loads any checkpoint into, except a ZeRO-2 checkpoint written before they became fully reshardable, which it
    loads at its own TP/PP/EP only: verify runs there (said in one line). With VPP the worker cannot build that
    layout and reads the weights with the conversion's reader instead (it says so)."""
    from megatron_patch.config.resume import bound_to_saved_layout

    saved = manifest.get("layout", {})
    tp, pp, ep = saved.get("tp", 1), saved.get("pp", 1), saved.get("ep", 1)
    etp = saved.get("etp", tp)
    if not bound_to_saved_layout(manifest) or saved.get("vpp", 1) > 1 or (tp, pp, ep, etp) == (1, 1, 1, 1):
        return 1, []
    nproc = pp * math.lcm(tp, ep * etp)
    experts = ["--ep", str(ep), "--etp", str(etp)] if "ep" in saved else []  # an MoE model's expert layout
    print(f"mcore2hf: verify at the checkpoint's own layout, TP {tp} PP {pp}" + (f" EP {ep} ETP {etp}" if experts
          else "") + f" ({nproc} processes): a ZeRO-2 checkpoint written before ZeRO-2 checkpoints became fully "
          f"reshardable loads into the engine at that layout only", flush=True)
    return nproc, ["--tp", str(tp), "--pp", str(pp), *experts]


def _export_peft(a: argparse.Namespace, reader, cfg, info: dict, rules, out: str) -> int:
    """A PEFT adapter directory of the LoRA checkpoint (conversion/lora_export.py), verified against the engine
    model (base + adapters) by loading it onto the base model with peft."""
    import torch

    from .lora_export import peft_tensors, write_peft

    base = reader.config.get("load_hf")
    if not base or not os.path.isdir(base):
        print(f"mcore2hf: the run's base model (--load-hf {base}) is not here: adapter_config.json names it, but "
              f"verification needs it", flush=True)
    tensors = peft_tensors(rules, reader, cfg, info["vocab_size"], info["padded_vocab_size"])
    name = a.dtype if a.dtype != "auto" else "fp32"
    write_peft(out, tensors, cfg, base, getattr(torch, DTYPES[name]))
    print(f"mcore2hf: PEFT adapters of {reader.path} (rank {cfg.lora_rank}, {len(tensors) // 2} modules) -> "
          f"{a.save_dir}; base model {base}", flush=True)
    if not a.verify:
        return 0
    nproc, layout = verify_layout(reader.manifest)
    return run_workers(nproc, ["verify", "--load-dir", a.load_dir, "--hf-dir", out, "--dtype", DTYPES[name], *layout]
                       + (["--debug"] if a.debug else []))


def _write_export(a: argparse.Namespace, reader, cfg, family: "Family", info: dict, rules, out: str) -> str:
    """Write config.json, the safetensors and the tokenizer files of the export into `out`; returns the
    dtype name written (fp32/bf16/fp16)."""
    import torch
    from tqdm import tqdm

    from .architecture import ExportChecker
    from .hf_io import HFCheckpointWriter
    from .mapping import dims, to_hf

    vocab, padded = info["vocab_size"], info["padded_vocab_size"]
    # a converted model keeps its original config.json; an engine-native one gets its tokenizer's end of document
    hf_config = dict(info.get("hf_config") or family.hf_config(cfg, vocab, _end_of_document(cfg, vocab)))
    hf_config = family.export_config(hf_config, cfg)  # e.g. BERT: the heads a bare BertModel original lacked
    name = a.dtype if a.dtype != "auto" else {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(
        info.get("hf_dtype") or "", "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "fp32")
    dtype = getattr(torch, DTYPES[name])
    hf_config.pop("torch_dtype", None)
    hf_config["dtype"] = DTYPES[name]
    print(f"mcore2hf: {reader.path} (iteration {reader.manifest['iteration']}, "
          f"{hf_config.get('model_type') or family.name}, layout "
          f"{reader.manifest['layout']}) -> {a.save_dir} ({name})", flush=True)
    t0 = time.time()
    check = ExportChecker(hf_config, f"{reader.path} -> {a.save_dir}")
    d = dims(cfg, vocab, padded)
    with HFCheckpointWriter(out, max_shard_bytes=_bytes(a.max_shard_size)) as writer:
        for hf_name, tensor in tqdm(to_hf(rules, reader.get, d), total=sum(len(r.hf) for r in rules),
                                    desc="tensors", disable=not sys.stderr.isatty()):
            check.add(hf_name, tuple(tensor.shape))
            writer.add(hf_name, tensor.to(dtype))
        check.finish()
        writer.close({"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
    copied = _export_tokenizer(reader.config, info, out)
    print(f"wrote config.json, {len(os.listdir(out)) - 1 - len(copied)} safetensors file(s), tokenizer files "
          f"{copied or 'none (the checkpoint names none)'} in {time.time() - t0:.1f} s", flush=True)
    return name


def main(argv: Optional[List[str]] = None) -> int:
    a = get_args(argv)
    from megatron_patch.training.checkpoint import CheckpointError

    from .hf_io import HFCheckpointError
    from .mapping import ConversionError

    try:
        return hf2mcore(a) if a.direction == "hf2mcore" else mcore2hf(a)
    except (ConversionError, HFCheckpointError, CheckpointError) as e:
        print(f"conversion error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the workers got it too; publish() said what is left (nothing)
        return 130
