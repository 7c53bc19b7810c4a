"""The model an engine checkpoint holds, every dimension spelled out.

A checkpoint stores the run's arguments as the run gave them: a flag left at its default is stored as
None (`--ffn-hidden-size`, `--kv-channels`, `--num-query-groups`, `--max-position-embeddings` before
validation) and the model builder fills it in. An export must describe the model that was built, not the
arguments: `resolve` runs the engine's own builder code (models.gpt.build_transformer_config, which makes
megatron-core's TransformerConfig fill its defaults: ffn 4 x hidden, kv_channels hidden / heads, query
groups = heads) and reads the dimensions back, so the export can never derive them differently from
the model that was trained.

`hf_parameter_shapes` is the other side: the parameters a transformers model of a config.json has, built
on the meta device (no memory), so that an export's tensors are checked against its config.json before
anything is published.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

from megatron_patch.config import Config


def resolve(cfg: Config) -> Config:
    """A copy of `cfg` whose model dimensions are those of the model the engine builds from it."""
    from megatron_patch.models.gpt import build_transformer_config

    # The architecture does not depend on the layout; building at TP1 PP1 avoids the layout's own checks.
    single = dataclasses.replace(cfg, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=1, expert_tensor_parallel_size=None,
                                 num_layers_per_virtual_pipeline_stage=None, sequence_parallel=False,
                                 recompute_granularity=None)
    built = build_transformer_config(single)
    return dataclasses.replace(
        cfg, ffn_hidden_size=built.ffn_hidden_size, kv_channels=built.kv_channels,
        num_query_groups=built.num_query_groups, norm_epsilon=built.layernorm_epsilon,
        moe_ffn_hidden_size=built.moe_ffn_hidden_size if cfg.num_experts else cfg.moe_ffn_hidden_size,
        # build_gpt_model / build_bert_model: GPTModel(max_sequence_length=...), the learned position rows
        max_position_embeddings=cfg.max_position_embeddings or cfg.seq_length)


def hf_parameter_shapes(hf_config: Dict) -> Dict[str, Tuple[int, ...]]:
    """name -> shape of every parameter of the transformers model `hf_config` describes (its first
    architecture); a tied parameter is listed once, under the name transformers saves it by. (transformers 5
    holds a mixture of experts' experts fused and renames them on saving: there the names differ from a
    checkpoint's; see check_export.)"""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**hf_config)
    cls = getattr(transformers, (config.architectures or [None])[0] or "", None)
    if cls is None:
        from .mapping import ConversionError

        raise ConversionError(f"config.json names the architecture {config.architectures}, which this transformers "
                              f"({transformers.__version__}) does not have")
    with torch.device("meta"):
        model = cls(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


class ExportChecker:
    """Checks an export's tensors, as they are written, against a transformers model of its config.json:
    each tensor the model has by name must have the model's shape; for a dense model the names must match
    exactly too (a mixture of experts' expert tensors are named differently in memory and are left to verify).
    A mismatch means config.json does not describe the weights (a dimension derived wrongly)."""

    def __init__(self, hf_config: Dict, where: str) -> None:
        self.expected = hf_parameter_shapes(hf_config)
        self.exact = not any(".experts." in n for n in self.expected)
        self.where, self.seen = where, set()

    def add(self, name: str, shape: Tuple[int, ...]) -> None:
        from .mapping import ConversionError

        want = self.expected.get(name)
        if want is None and self.exact:
            raise ConversionError(f"{self.where}: the export has {name}, which a transformers model of its config.json "
                                  f"does not have (tied or untied output layer, biases?)")
        if want is not None and tuple(shape) != want:
            raise ConversionError(f"{self.where}: {name} has the shape {tuple(shape)} in the checkpoint, a transformers "
                                  f"model of the exported config.json has {want}: the checkpoint's stored arguments "
                                  f"and its weights disagree")
        self.seen.add(name)

    def finish(self) -> None:
        from .mapping import ConversionError

        missing = sorted(set(self.expected) - self.seen) if self.exact else []
        if missing:
            raise ConversionError(f"{self.where}: a transformers model of the exported config.json has "
                                  f"{len(missing)} parameter(s) the checkpoint does not give, e.g. "
                                  f"{', '.join(missing[:3])}")
