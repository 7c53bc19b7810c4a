"""Post-LayerNorm (the original BERT's arrangement) on megatron-core's pre-LN modules.

megatron-core 0.19.2 builds only pre-LN layers: TransformerLayer normalises a sub-block's *input*
(`input_layernorm`, `pre_mlp_layernorm`) and adds the un-normalised residual after it; the config field
`apply_residual_connection_post_layernorm` is declared but read nowhere. Its embedding
(LanguageModelEmbedding) has no LayerNorm. BERT and Hugging Face's `BertModel` normalise *after* each
residual add, and the embedding sum before its dropout:

    x = LN(word + position + tokentype); x = dropout(x)
    x = LN(x + Attention(x));  x = LN(x + MLP(x))

The pieces here keep megatron-core's own forward code and change it at points that are not public API,
hence this module:

- `post_layernorm_transformer_layer()`: a TransformerLayer subclass whose `_forward_attention` result (after the
  attention's bias-dropout-add) and `_forward_post_mlp` result (after the MLP's bias-dropout-add) pass
  through `post_attention_layernorm` / `post_mlp_layernorm`. Its spec leaves input_layernorm and
  pre_mlp_layernorm as IdentityOp, so the residual each sub-block adds is the normalised stream.
- `drop_final_layernorm`: BertModel builds its TransformerBlock from a layer spec, which megatron-core
  completes with a final LayerNorm (the pre-LN closing norm); post-LN has none, so it is removed.
- `norm_before_embedding_dropout`: LanguageModelEmbedding.forward ends with `embedding_dropout(sum)`;
  a forward pre-hook on that dropout normalises the sum first (after the sequence-parallel scatter,
  which is per-token and so commutes with the LayerNorm).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .registry import register

_LAYER = "megatron/core/transformer/transformer_layer.py:"


@register(upstream=(_LAYER + "TransformerLayer.forward", _LAYER + "TransformerLayer._forward_attention",
                    _LAYER + "TransformerLayer._forward_mlp", _LAYER + "TransformerLayer._forward_post_mlp"),
          fixes="megatron-core's TransformerLayer is pre-LN only (apply_residual_connection_post_layernorm is never "
                "read): normalise the stream after each bias-dropout-add, i.e. the results of the private steps "
                "_forward_attention and _forward_post_mlp, for the original BERT's post-LN layer",
          fingerprint="31c8f12e3f357194")
@functools.cache  # one class per process (built on first use: importing compat must not import megatron-core)
def post_layernorm_transformer_layer() -> type:
    """The class `PostLayerNormTransformerLayer(TransformerLayer)`: x = LN(x + Attn(x)); x = LN(x + MLP(x)).

    Use it as a layer spec's module with `params={"post_layernorm": <norm builder>}` (megatron-core's norm
    signature: config, hidden_size, eps) and input_layernorm / pre_mlp_layernorm left as IdentityOp; the
    norms are the layer's `post_attention_layernorm` and `post_mlp_layernorm`."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class PostLayerNormTransformerLayer(TransformerLayer):
        __doc__ = post_layernorm_transformer_layer.__doc__

        def __init__(self, config, submodules, *args, post_layernorm=None, **kwargs) -> None:
            super().__init__(config, submodules, *args, **kwargs)
            if post_layernorm is None or not isinstance(self.input_layernorm, IdentityOp) \
                    or not isinstance(self.pre_mlp_layernorm, IdentityOp):
                raise ValueError("a post-LayerNorm layer normalises after the residual adds: give its spec "
                                 "params={'post_layernorm': ...} and leave input_layernorm / pre_mlp_layernorm IdentityOp")
            norm = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
            self.post_attention_layernorm = post_layernorm(**norm)
            self.post_mlp_layernorm = post_layernorm(**norm)

        def _forward_attention(self, *args, **kwargs):
            hidden_states, context = super()._forward_attention(*args, **kwargs)
            return self.post_attention_layernorm(hidden_states), context

        def _forward_post_mlp(self, mlp_output_with_bias, residual):
            return self.post_mlp_layernorm(super()._forward_post_mlp(mlp_output_with_bias, residual))

    PostLayerNormTransformerLayer.__qualname__ = PostLayerNormTransformerLayer.__name__
    return PostLayerNormTransformerLayer


@register(upstream="megatron/core/models/common/embeddings/language_model_embedding.py:LanguageModelEmbedding.forward",
          fixes="LanguageModelEmbedding has no LayerNorm; BERT normalises the embedding sum before its dropout: a "
                "forward pre-hook on `embedding_dropout` (the last step of forward) applies `norm` to its input",
          fingerprint="fd651491d08f7efe")
def norm_before_embedding_dropout(embedding: torch.nn.Module, norm: torch.nn.Module,
                                  name: str = "layernorm") -> Optional[torch.utils.hooks.RemovableHandle]:
    """Make `norm` a submodule of `embedding` (as `name`) applied to the embedding sum right before its dropout."""
    embedding.add_module(name, norm)
    return embedding.embedding_dropout.register_forward_pre_hook(_NormInput(embedding, name))


class _NormInput:
    """The pre-hook: looks the norm up by name on each call (no second reference to its parameters)."""

    def __init__(self, owner: torch.nn.Module, name: str) -> None:
        self.owner, self.name = owner, name

    def __call__(self, module, args):
        return (getattr(self.owner, self.name)(args[0]),) + tuple(args[1:])


@register(upstream=("megatron/core/models/bert/bert_model.py:BertModel.__init__",
                    "megatron/core/models/bert/bert_model.py:BertModel._sanity_check_attention_and_get_attn_mask_dimension",
                    "megatron/core/transformer/transformer_block.py:_get_block_submodules",
                    "megatron/core/transformer/transformer_block.py:TransformerBlock.forward"),
          fixes="BertModel insists on a layer spec (its attention-mask check asserts TransformerLayerSubmodules) and "
                "TransformerBlock completes a layer spec with a final LayerNorm on the last stage (pre-LN's closing "
                "norm); a post-LN stack already ends normalised: remove that norm from the built block",
          fingerprint="da3e2be8cfc19250")
def drop_final_layernorm(block: torch.nn.Module) -> None:
    """Remove the final LayerNorm of megatron-core TransformerBlock `block` (none: nothing to do)."""
    if getattr(block, "final_layernorm", None) is not None:
        block.final_layernorm = None  # forward skips a None final_layernorm; the state dict drops it
