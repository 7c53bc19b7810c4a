"""The conversion's work that needs the engine's model, run in TP x PP processes started by
`megatron_patch.conversion.convert` (torchrun, gloo on the CPU):

  hf2mcore     build the model in the target layout, load the Hugging Face weights into it (the same
               shim as --load-hf), write an engine checkpoint with the weights only
  verify       build the model (fp32, --tp/--pp layout), load an engine checkpoint into it through the engine's
               own checkpoint loading (not the export's reader) and compare its logits (BERT: hidden states and
               heads) with a Hugging Face directory's

`python -m megatron_patch.conversion.worker {hf2mcore|verify} ... --status-dir DIR` (not meant to be run by
hand). The engine configuration is built here as a Config (`engine_config`): the architecture from the family's
mapping of config.json (hf2mcore) or from the checkpoint's stored one (verify), the layout from the parent.
Each process writes its outcome (result.py: status 0 ok, 2 conversion error, 3 failed verify, and a message) to
DIR/rank_<r>.json: the parent reads its workers' verdict there, not from torchrun's log or exit status.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional

import torch

from megatron_patch.conversion.result import BAD_INPUT, FAILED_VERIFY, OK, WorkerResult, write_result

# What the conversion's Config says of training, which it never does: the settings stored with an hf2mcore
# checkpoint (its weights, no data, no step taken). Its Config is checked by the model's rules only
# (config/validate.py: validate_model), not by those of a training run.
NOT_TRAINED = dict(mock_data=True, micro_batch_size=1, train_iters=1, eval_iters=0)


def engine_config(args, model: Dict, **settings):
    """The engine Config of the model to convert: its architecture (`model`: Config fields), the worker's layout
    (--tp/--pp/--ep/--etp), and `settings` (precision, --load-hf, --save ...)."""
    from megatron_patch.config import Config

    cfg = Config.from_flat(model).replace(**NOT_TRAINED,
                 tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                 expert_model_parallel_size=args.ep, expert_tensor_parallel_size=args.etp,
                 # megatron-core builds a tensor-parallel MoE layer only with sequence parallelism (validate() says
                 # so for training); it changes how activations are split, not the weights
                 sequence_parallel=bool(model.get("num_experts")) and args.tp > 1, **settings)
    # the random tokens of mock data: the model's whole vocabulary (unused)
    return cfg.replace(vocab_size=cfg.model_vocab_size, seq_length=min(cfg.max_position_embeddings or args.seq, args.seq))


def initialize_model_run(cfg):
    """Process groups for the conversion's model: its Config checked by the model's rules only."""
    from megatron_patch.config.validate import validate_model
    from megatron_patch.parallel import initialize
    from megatron_patch.parallel.initialize import world_size_from_env

    return initialize(validate_model(cfg, world_size_from_env()))


def verify_length(cfg, seq: int) -> int:
    """Positions verify runs: every row of learned position embeddings (a wrong row beyond `seq` would
    otherwise never be compared); with RoPE, which has no per-position weights, `seq` (at most the model's
    maximum)."""
    if cfg.position_embedding_type == "learned_absolute" and cfg.max_position_embeddings:
        return cfg.max_position_embeddings
    return min(cfg.max_position_embeddings or seq, seq)


def _hf_model(hf_dir: str):
    """The Hugging Face model of `hf_dir` in fp32; a PEFT adapter directory on its base model (peft)."""
    from transformers import AutoModelForCausalLM

    adapter = os.path.join(hf_dir, "adapter_config.json")
    if os.path.isfile(adapter):
        from peft import PeftModel

        with open(adapter) as f:
            base = json.load(f)["base_model_name_or_path"]
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        return PeftModel.from_pretrained(model, hf_dir).eval()
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def _is_reporting_rank() -> bool:
    from megatron.core import parallel_state as mpu

    return mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0


def hf2mcore(args) -> int:
    """Build the model in the target layout in the Hugging Face dtype, load the weights, save them."""
    from megatron_patch.conversion import tables
    from megatron_patch.conversion.hf_source import HFWeights
    from megatron_patch.models.build import build_model, model_info
    from megatron_patch.training.checkpoint import Checkpointer, TrainState

    weights = HFWeights(args.load_dir)  # its config.json, and the loader of its weights
    config = weights.hf_config
    arch = tables.for_model_type(config.get("model_type", "")).engine_args(config)
    cfg = engine_config(args, arch, load_hf=args.load_dir, save=args.save_dir,
                        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                        bf16=args.hf_dtype == "bfloat16", fp16=args.hf_dtype == "float16")  # exact: no rounding
    cfg = initialize_model_run(cfg)
    model = build_model(cfg, cfg.model_vocab_size, for_training=False, load_weights=weights)  # no gradient buffers
    info = model_info(cfg, cfg.model_vocab_size, weights.hf_config)
    info["hf_dtype"] = args.hf_dtype
    # Written into the parent's staging directory (--save-dir), which it renames to --publish-dir once verified:
    # the stored configuration names the directory the checkpoint is published as, not the staging one.
    cfg = cfg.replace(save=args.publish_dir or args.save_dir)
    Checkpointer(cfg, model, None, None, model_info=info).save(TrainState(), consume_model=True, root=args.save_dir)
    return OK


def verify_checkpoint(args) -> int:
    """Build the model of an engine checkpoint in fp32, in the --tp/--pp layout, load its weights through the
    engine's own checkpoint loading (the resume path: torch_dist, or Megatron-FSDP's fsdp_dtensor for ZeRO-2),
    and compare it with the Hugging Face directory. The loading is independent of the reader that exports
    (mcore_reader.py), so a reader bug fails verify instead of being repeated by it."""
    from megatron_patch.config.checkpoint_layout import read_manifest
    from megatron_patch.config.model_source import ARCHITECTURE, LORA
    from megatron_patch.config.resume import at_saved_layout, bound_to_saved_layout, layout
    from megatron_patch.conversion.mcore_reader import FSDP_DTENSOR, resolve_checkpoint  # no tensor read
    from megatron_patch.conversion.verify import verify
    from megatron_patch.parallel import print_rank_0

    path = resolve_checkpoint(args.load_dir)  # the iter_XXXXXXX directory the export read
    manifest = read_manifest(path)
    stored, info = manifest.get("config", {}), manifest.get("model", {})
    arch = {key: stored[key] for key in ARCHITECTURE if key in stored}  # stored with the checkpoint
    if stored.get("lora_rank"):  # the engine model with its adapters, against the merged export or PEFT
        arch.update({key: stored[key] for key in LORA if key in stored})
    arch.update(model_vocab_size=info["vocab_size"], padded_vocab_size=info["padded_vocab_size"])
    zero2 = manifest.get("format") == FSDP_DTENSOR  # Megatron-FSDP's format: loads only into its wrapped model
    cfg = engine_config(args, arch, zero_2_memory_optimization=zero2)
    cfg = cfg.replace(seq_length=verify_length(cfg, args.seq))
    cfg = initialize_model_run(cfg)
    if bound_to_saved_layout(manifest) and not at_saved_layout(manifest, layout(cfg)):
        # the engine loads it at its own layout only (mcore2hf starts verify there: convert.verify_layout), except
        # with VPP, which the worker does not build
        print_rank_0(f"verify used the conversion's reader for {path}: a ZeRO-2 checkpoint of layout "
                     f"{manifest['layout']}, written before ZeRO-2 checkpoints became fully reshardable, loads into the "
                     f"engine at that layout only (verify runs at {layout(cfg)})")
        model = _reader_model(cfg, path)
    else:
        model = engine_model(cfg, path)
    if args.dtype:  # the export's dtype: compare with the weights it holds (a ZeRO-2 bf16 run saves fp32 main weights)
        saved = saved_weights_dtype(manifest)
        if saved != args.dtype:
            print_rank_0(f"verify: the checkpoint's {saved} weights rounded to {args.dtype}, the dtype of the export")
        round_weights(model, args.dtype)
    load_hf, check = _hf_model, verify
    if cfg.model_family == "bert":  # an encoder: hidden states and the heads both sides have (verify_bert.py)
        from megatron_patch.conversion.verify_bert import hf_bert_model as load_hf, verify_bert as check
    hf = load_hf(args.hf_dir) if _is_reporting_rank() else None
    ok = check(model, hf, cfg.model_vocab_size, cfg.seq_length, debug=args.debug, log=print_rank_0)
    return OK if ok else FAILED_VERIFY


def engine_model(cfg, path: str) -> List:
    """This rank's bare fp32 model chunks with the weights of checkpoint `path` (an iter_XXXXXXX directory), loaded
    by the engine as resuming loads them (Checkpointer.load_weights: same checks, same backend), weights only.
    A ZeRO-2 checkpoint loads into the model as training wraps it (Megatron-FSDP, with its optimizer, whose state
    is not read); its compute weights are then copied into bare chunks, which verify runs like any other."""
    from megatron_patch.models.build import build_model, build_model_chunks, wrap_model
    from megatron_patch.training.checkpoint import Checkpointer

    bare = build_model(cfg, cfg.model_vocab_size, for_training=False)  # no gradient buffers
    if not cfg.zero_2_memory_optimization:
        Checkpointer(cfg, bare, None, None).load_weights(path)
        return bare
    from megatron_patch.compat.megatron_fsdp import use_raw_params
    from megatron_patch.training.optimizer import build_optimizer

    wrapped = wrap_model(cfg, build_model_chunks(cfg, cfg.model_vocab_size))
    optimizer, _ = build_optimizer(cfg, wrapped)  # fsdp_dtensor.load describes the state through it
    Checkpointer(cfg, wrapped, optimizer, None).load_weights(path)
    use_raw_params(wrapped)  # the weights a forward pass computes with, this rank's TP part
    _copy_weights(wrapped, bare)
    return bare


@torch.no_grad()
def _copy_weights(sources: List, targets: List) -> None:
    """Every parameter of the (wrapped) chunks `sources` into the same-named one of the bare chunks `targets`."""
    from megatron_patch.training.checkpoint.torch_dist import unwrap

    for source, target in zip(sources, targets):
        given = dict(unwrap(source).named_parameters())
        for name, p in target.named_parameters():
            p.copy_(given[name])


def _reader_model(cfg, path: str) -> List:
    """This rank's bare fp32 model chunks filled from the conversion's reader (the export's own source): only for a
    checkpoint the engine cannot load at this layout."""
    from megatron_patch.conversion.load_hf import load_global_weights
    from megatron_patch.conversion.mcore_reader import MegatronCheckpointReader
    from megatron_patch.models.build import build_model

    reader = MegatronCheckpointReader(path)
    model = build_model(cfg, cfg.model_vocab_size, for_training=False)
    load_global_weights(model, cfg, lambda name: reader.get(name).float(), reader.keys(), path)
    return model


def saved_weights_dtype(manifest: Dict) -> str:
    """The dtype the checkpoint of `manifest` holds its weights in: Megatron-FSDP (ZeRO-2) saves its fp32 main
    weights, dist_checkpointing (ZeRO-0/1, conversions) the model's own, in the run's precision."""
    from megatron_patch.config import Config
    from megatron_patch.conversion.mcore_reader import FSDP_DTENSOR

    if manifest.get("format") == FSDP_DTENSOR:
        return "float32"
    cfg = Config.from_flat(manifest.get("config", {}))  # the run's precision, as any version stored it
    return "bfloat16" if cfg.bf16 else "float16" if cfg.fp16 else "float32"


@torch.no_grad()
def round_weights(chunks: List, dtype: str) -> None:
    """Every parameter of `chunks` rounded to `dtype` (a torch dtype's name) and kept in its own dtype: the values
    an export in `dtype` holds."""
    to = getattr(torch, dtype)
    for chunk in chunks:
        for p in chunk.parameters():
            p.copy_(p.to(to))


def _report(status_dir: Optional[str], status: int, message: str = "") -> None:
    """This process's outcome, for the parent (convert.run_workers reads it)."""
    if status_dir:
        write_result(status_dir, WorkerResult(int(os.environ.get("RANK", "0")), status, message))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("task", choices=["hf2mcore", "verify"])
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir")
    p.add_argument("--publish-dir", help="hf2mcore: the directory --save-dir becomes (the stored --save)")
    p.add_argument("--hf-dir")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hf-dtype")
    p.add_argument("--dtype", help="verify: round the checkpoint's weights to this torch dtype first (the export's)")
    p.add_argument("--debug", action="store_true")
    p.add_argument("--status-dir", help="where this process writes its outcome (rank_<r>.json)")
    args = p.parse_args(argv)
    from megatron_patch.config import ConfigError
    from megatron_patch.conversion.hf_io import HFCheckpointError
    from megatron_patch.conversion.mapping import ConversionError
    from megatron_patch.parallel import destroy
    from megatron_patch.training.checkpoint import CheckpointError

    try:
        status = hf2mcore(args) if args.task == "hf2mcore" else verify_checkpoint(args)
        _report(args.status_dir, status)
        return status
    except (ConversionError, HFCheckpointError, CheckpointError, ConfigError) as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"conversion error: {e}", file=sys.stderr, flush=True)
        _report(args.status_dir, BAD_INPUT, str(e))
        return BAD_INPUT
    finally:
        destroy()


if __name__ == "__main__":  # dist_checkpointing starts helper processes: keep the guard
    sys.exit(main())
