"""Exporting a LoRA checkpoint (models/lora.py): merged into the base weights, or as a PEFT adapter directory.

Merged (`mcore2hf`, the default): every adapted weight read through `MergedLoRAReader` is W + (alpha / rank) B A,
computed in fp32 from the checkpoint's full tensors, and the family's table exports the model as usual; the
checkpoint's other tensors are the frozen base.

PEFT (`mcore2hf --lora-format peft`): `adapter_model.safetensors` + `adapter_config.json`, which
`peft.PeftModel.from_pretrained(base, dir)` loads onto the base model the run started from (`--load-hf`, named in
adapter_config.json's base_model_name_or_path). The engine's fused layers hold one adapter for several Hugging Face
modules; B's rows are split as the table splits the layer's weight rows (q/k/v of linear_qkv with the grouped-query
layout undone, gate/up of a SwiGLU linear_fc1), and each module gets the shared A: q = Wq x + s Bq A x, and so on.
Keys follow PEFT's names: `base_model.model.<module>.lora_A.weight` [rank, in] and `.lora_B.weight` [out, rank].
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Sequence

import torch

from megatron_patch.config.lora_targets import is_adapter

from .mapping import ConversionError, Rule, TensorIndex, dims, to_hf


class MergedLoRAReader(TensorIndex):
    """A checkpoint reader whose adapted weights come merged (W + scale B A) and whose adapters are hidden."""

    def __init__(self, reader, cfg) -> None:
        self.reader, self.scale = reader, cfg.lora_alpha / cfg.lora_rank
        self._where = {k: None for k in reader.keys() if not is_adapter(k)}
        self.path, self.manifest, self.config = reader.path, reader.manifest, reader.config

    def get(self, name: str) -> torch.Tensor:
        w = self.reader.get(name)
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is None or f"{module}.lora_A" not in self.reader:
            return w
        a, b = self.reader.get(f"{module}.lora_A").float(), self.reader.get(f"{module}.lora_B").float()
        return (w.float() + self.scale * (b @ a)).to(w.dtype)

    def dtype_of(self, name: str) -> torch.dtype:
        return self.reader.dtype_of(name)


def adapted_rules(rules: Sequence[Rule], reader) -> List[Rule]:
    """The table's rules of the weights that carry an adapter in the checkpoint."""
    out = [r for r in rules if r.mcore.endswith(".weight") and f"{r.mcore[:-len('.weight')]}.lora_A" in reader]
    if not out:
        raise ConversionError(f"{reader.path}: the checkpoint's configuration says LoRA, but it holds no adapter")
    return out


def peft_tensors(rules: Sequence[Rule], reader, cfg, vocab: int, padded: int) -> Dict[str, torch.Tensor]:
    """PEFT's adapter tensors of a LoRA checkpoint: B's rows split per Hugging Face module by the table's
    transform of the layer's weight, A shared."""
    for r in rules:
        if r.transform.name == "conv1d_transpose":
            raise ConversionError(f"{r.mcore}: a Conv1D module (GPT-2) takes PEFT adapters transposed "
                                  f"(fan_in_fan_out); export this model with --lora-format merged")
    d = dims(cfg, vocab, padded)
    out: Dict[str, torch.Tensor] = {}
    for rule in adapted_rules(rules, reader):
        module = rule.mcore[: -len(".weight")]
        a = reader.get(f"{module}.lora_A")
        for hf_name, b in to_hf([rule], lambda _name, m=module: reader.get(f"{m}.lora_B"), d):
            prefix = "base_model.model." + hf_name[: -len(".weight")]
            out[f"{prefix}.lora_A.weight"] = a.clone()
            out[f"{prefix}.lora_B.weight"] = b.contiguous()
    return out


def write_peft(out_dir: str, tensors: Dict[str, torch.Tensor], cfg, base: str, dtype: torch.dtype) -> None:
    """adapter_model.safetensors and adapter_config.json (PEFT's LORA format) into `out_dir`."""
    from safetensors.torch import save_file

    modules = sorted({k.split(".")[-3] for k in tensors})
    save_file({k: v.to(dtype) for k, v in tensors.items()}, os.path.join(out_dir, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha,
              "lora_dropout": cfg.lora_dropout, "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
              "base_model_name_or_path": os.path.abspath(base) if base else None, "modules_to_save": None}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
