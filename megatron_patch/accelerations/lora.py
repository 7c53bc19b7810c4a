"""--lora-rank for Hugging Face models (rapidformer's tasks, Finetuner, PreTrainer): LoRA adapters through the `peft`
library, the rest of the model frozen. Applied first, on the plain model: DDP/FSDP2, compile and the optimizer then
see a PeftModel whose only trainable parameters are the adapters (and a task head, which PEFT's task types keep
trainable as `modules_to_save`). `save_pretrained` of the result writes PEFT's adapter directory
(adapter_config.json + adapter_model.safetensors), which `peft.PeftModel.from_pretrained(base, dir)` loads.

--lora-target: Hugging Face module names are passed to peft as they are; the engine's default (its fused Megatron
layers linear_qkv linear_proj linear_fc1 linear_fc2) means every linear layer of the model but its output head
(peft's "all-linear"), and a Megatron name given explicitly means the model's modules of that role.
"""
from __future__ import annotations

import os
from typing import List, Union

import torch

from megatron_patch.config.lora_targets import MEGATRON_TARGETS

# The model class's suffix -> peft's task type (its PeftModel keeps the task's head trainable)
TASK_TYPES = (("ForSequenceClassification", "SEQ_CLS"), ("ForTokenClassification", "TOKEN_CLS"),
              ("ForQuestionAnswering", "QUESTION_ANS"), ("ForCausalLM", "CAUSAL_LM"), ("LMHeadModel", "CAUSAL_LM"),
              ("ForConditionalGeneration", "SEQ_2_SEQ_LM"), ("ForSeq2SeqLM", "SEQ_2_SEQ_LM"))
# Megatron's fused layers -> the module names they are in common Hugging Face architectures
ROLES = {"linear_qkv": ("q_proj", "k_proj", "v_proj", "query", "key", "value", "c_attn", "qkv_proj", "Wqkv"),
         "linear_proj": ("o_proj", "out_proj", "c_proj", "dense"), "linear_fc1": ("gate_proj", "up_proj", "fc1", "c_fc",
                                                                                  "intermediate.dense", "wi"),
         "linear_fc2": ("down_proj", "fc2", "output.dense", "wo")}


def _targets(model: torch.nn.Module, names: List[str]) -> Union[str, List[str]]:
    if list(names) == list(MEGATRON_TARGETS):
        return "all-linear"
    out = []
    present = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"}
    for name in names:
        if name in MEGATRON_TARGETS:
            out += [r for r in ROLES[name] if any(p == r or p.endswith("." + r) for p in present)]
        else:
            out.append(name)
    missing = [n for n in names if n not in MEGATRON_TARGETS and not any(p == n or p.endswith("." + n) for p in present)]
    if missing or not out:
        raise ValueError(f"--lora-target {' '.join(names)}: the model has no linear module named {', '.join(missing) or names[0]} "
                         f"(its linear modules end in: {', '.join(sorted({p.rsplit('.', 1)[-1] for p in present})[:12])})")
    return sorted(set(out))


def apply_lora(model: torch.nn.Module, args) -> "tuple[torch.nn.Module, str]":
    """`model` as a peft PeftModel with LoRA adapters of --lora-rank/--lora-alpha/--lora-dropout on --lora-target;
    returns it and a phrase for the log."""
    from peft import LoraConfig, get_peft_model

    cls = type(model).__name__
    task = next((t for suffix, t in TASK_TYPES if cls.endswith(suffix)), None)
    targets = _targets(model, list(getattr(args, "lora_target", MEGATRON_TARGETS)))
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=targets, task_type=task)
    fan_in_fan_out = any(type(m).__name__ == "Conv1D" for m in model.modules())  # GPT-2's transposed linears
    if fan_in_fan_out:
        config.fan_in_fan_out = True
    peft_model = get_peft_model(model, config)
    base = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if base and os.path.isdir(base):  # adapter_config.json names the base model wherever it is loaded from
        peft_model.peft_config["default"].base_model_name_or_path = os.path.abspath(base)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    where = targets if isinstance(targets, str) else " ".join(targets)
    return peft_model, (f"LoRA (peft): rank {args.lora_rank}, alpha {args.lora_alpha:g} on {where}"
                        f"{', task head trained' if task in ('SEQ_CLS', 'TOKEN_CLS', 'QUESTION_ANS') else ''}: "
                        f"{trainable / 1e6:.3f}M of {total / 1e6:.1f}M parameters trained")

