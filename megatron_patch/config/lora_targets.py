"""The layers `--lora-target` names: megatron-core's (fused) layer names, or Hugging Face's module names mapped onto
them. Shared by the configuration's checks and the engine's LoRA (models/lora.py); torch-free."""
from __future__ import annotations

from typing import List, Sequence

ADAPTER_KEYS = (".lora_A", ".lora_B")  # an adapted layer's tensors in the state dict and the checkpoint


def is_adapter(name: str) -> bool:
    """Whether state-dict / checkpoint name `name` is a LoRA adapter tensor."""
    return name.endswith(ADAPTER_KEYS)


MEGATRON_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# Hugging Face module names -> the fused megatron-core layer they are part of
HF_TARGETS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
              "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2",
              # GPT-2 / BERT-style names
              "c_attn": "linear_qkv", "c_proj": "linear_proj", "c_fc": "linear_fc1"}
FUSED = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_fc1": ("gate_proj", "up_proj")}


def resolve_targets(names: Sequence[str], gated: bool = True) -> List[str]:
    """The megatron-core layers that `--lora-target` names (Megatron or Hugging Face names); ValueError naming the
    fix for an unknown name or a part of a fused layer without the rest."""
    out: List[str] = []
    for name in names:
        layer = name if name in MEGATRON_TARGETS else HF_TARGETS.get(name)
        if layer is None:
            raise ValueError(f"--lora-target {name}: not a layer LoRA can adapt; use {' '.join(MEGATRON_TARGETS)} or "
                             f"the Hugging Face names {' '.join(sorted(HF_TARGETS))}")
        if layer not in out:
            out.append(layer)
    for layer, parts in FUSED.items():
        if layer == "linear_fc1" and not gated:
            continue
        named = [p for p in parts if p in names]
        if named and len(named) != len(parts):
            missing = sorted(set(parts) - set(named))
            raise ValueError(f"--lora-target {' '.join(named)} without {' '.join(missing)}: the engine fuses "
                             f"{'/'.join(parts)} into one layer ({layer}); name all of them, or {layer}")
    return out
