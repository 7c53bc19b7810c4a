"""How a model chunk's parameters relate to the whole model: global names and tensor-parallel slices.

A chunk (one pipeline stage, or one virtual stage) numbers its layers from 0 and holds, for each
tensor-parallel parameter, this rank's slice. Layout-invariant initialization and loading Hugging Face
weights both start from the *global* tensor and need this rank's part of it.
"""
from __future__ import annotations

import re

import torch
from megatron.core import parallel_state as mpu


def global_name(name: str, module) -> str:
    """`name` in `module` (an unwrapped GPTModel or BertModel chunk) as the TP1/PP1/EP1 model would call it: global layer
    number, global expert number (an EP rank holds experts [rank * local, (rank + 1) * local) of each MoE
    layer as local_experts.0, 1, ...), and a tied output layer named after the embedding it copies."""
    m = re.search(r"(decoder|encoder)\.layers\.(\d+)\.", name)  # GPTModel's decoder, BertModel's encoder
    if m:
        stack = m.group(1)
        layer = getattr(module, stack).layers[int(m.group(2))]
        e = re.search(r"\.mlp\.experts\.local_experts\.(\d+)\.", name)
        if e:
            expert = layer.mlp.local_expert_indices[int(e.group(1))]
            name = name.replace(e.group(0), f".mlp.experts.local_experts.{expert}.")
        name = name.replace(m.group(0), f"{stack}.layers.{layer.layer_number - 1}.")
    if name == "output_layer.weight" and getattr(module, "share_embeddings_and_output_weights", False):
        name = "embedding.word_embeddings.weight"
    return name


def is_expert_param(name: str) -> bool:
    """A routed expert's weight (sharded over the expert-tensor-parallel group, not the TP group)."""
    return ".mlp.experts." in name


def _tp(name: str):
    """(size, rank) of the tensor-parallel group that slices parameter `name`: ETP for routed experts."""
    if is_expert_param(name):
        return mpu.get_expert_tensor_parallel_world_size(), mpu.get_expert_tensor_parallel_rank()
    return mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()


def global_shape(param: torch.Tensor, name: str = "") -> list:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= _tp(name)[0]
    return shape


def local_shard(full: torch.Tensor, param: torch.Tensor, name: str, gated_linear_unit: bool) -> torch.Tensor:
    """This tensor-parallel rank's slice of the global tensor `full` of parameter `param` (global `name`).

    Column-parallel weights are cut along rows, row-parallel along columns; megatron-core's QKV rows are
    ordered by query group, so a contiguous cut gives each rank whole groups. SwiGLU's fc1 is [gate; up]
    globally but [gate_r; up_r] on rank r."""
    tp, rank = _tp(name)
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim = param.partition_dim
    if gated_linear_unit and "linear_fc1" in name and dim == 0:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    return full.chunk(tp, dim=dim)[rank]
