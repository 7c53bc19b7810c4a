"""Mixture of experts without the host: a dropless token dispatcher for one expert-parallel rank whose shapes are
known without reading any token count (`--moe-grouped-gemm` at EP 1 and expert TP 1).

megatron-core's dispatchers read the number of tokens per expert on the host in every MoE layer (the all-to-all
dispatcher's split sizes, the permutation's output size: `.tolist()` / `.cpu()`), which makes the host wait for the
GPU twice per layer and micro batch, and gives torch.compile data-dependent shapes (so compile.py left MoE layers
out). With every expert on this rank and no token dropped, none of that is needed: each token goes to exactly
top-k experts, so the permuted tokens are always tokens x top-k rows. The dispatcher here

- takes each token's top-k experts from the router's routing map (`topk` of the 0/1 map: [tokens, k]),
- sorts the tokens x k assignments by expert (stable: expert-major, token order within an expert: the order of
  megatron-core's `permute`), gathers the tokens and their routing probabilities in that order,
- counts the tokens per expert on the device (a scatter-add into [experts], no bincount: its size would depend on
  the data), which the grouped GEMM takes as device offsets (models/grouped_experts.py),
- and adds each expert output back to its token (index_add), the probabilities having been applied inside the
  experts, as megatron-core's MLP does.

Same arithmetic as the all-to-all dispatcher at EP 1 (the same rows in the same order into the same grouped GEMMs;
only the order of the final sum over a token's k experts may differ). Static shapes: the whole MoE layer compiles
(compile.py) and no step waits on the host for it. The swap of each MoE layer's `token_dispatcher` is a compat
patch (compat/moe.py use_token_dispatcher).
"""
from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch


class DeviceTokenDispatcher:
    """megatron-core's MoETokenDispatcher interface (dispatch_preprocess ... combine_postprocess) for EP 1, dropless,
    with every size fixed by the token count and top-k (see the module docstring)."""

    def __init__(self, config, num_experts: int, topk: int) -> None:
        self.config = config
        self.num_experts, self.topk = num_experts, topk
        self.shared_experts = None
        self.cudagraph_attrs, self.valid_cudagraph_attrs = [], None  # megatron-core's CUDA-graph hooks read these
        self.routing_map: Optional[torch.Tensor] = None
        self.tokens_per_expert: Optional[torch.Tensor] = None
        self._token_index: Optional[torch.Tensor] = None
        self._shape = None

    def set_shared_experts(self, shared_experts) -> None:  # megatron-core calls it only for overlapped experts
        raise ValueError("the device token dispatcher does not overlap shared experts with communication (there is "
                         "none at EP 1): drop --moe-shared-expert-overlap")

    def get_expert_zero_copy_buffers(self) -> Tuple[None, None]:
        return None, None

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        self._shape = hidden_states.shape
        self.routing_map = routing_map
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        # each token's k experts (a row of the map has exactly k ones when nothing is dropped)
        experts = torch.topk(routing_map.to(torch.float32), self.topk, dim=1, sorted=False).indices.reshape(-1)
        order = torch.argsort(experts, stable=True)
        self._token_index = torch.div(order, self.topk, rounding_mode="floor")
        expert_of_row = experts.index_select(0, order)
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=experts.device).scatter_add_(
            0, experts, torch.ones_like(experts))
        permuted = tokens.index_select(0, self._token_index)
        permuted_probs = probs[self._token_index, expert_of_row]
        return permuted, permuted_probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        return hidden_states, probs  # one rank: nothing to send

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return hidden_states, tokens_per_expert, probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((self._shape[:-1].numel(), hidden_states.shape[-1]), dtype=hidden_states.dtype,
                          device=hidden_states.device)
        out = out.index_add(0, self._token_index, hidden_states)
        self._token_index = None
        return out.view(self._shape)


def device_dispatch_refusal(layer) -> Optional[str]:
    """Why `layer` (a megatron-core MoELayer) keeps megatron-core's dispatcher, or None when the device one fits."""
    c = layer.config
    if not getattr(layer.experts, "grouped_gemm", False):
        return "its experts are not grouped GEMMs (--moe-grouped-gemm, several experts per rank)"
    if layer.token_dispatcher.ep_size > 1 or layer.token_dispatcher.tp_size > 1:
        return "experts are spread over ranks (expert or expert-tensor parallelism)"
    if c.moe_expert_capacity_factor is not None or c.moe_pad_expert_input_to_capacity:
        return "tokens may be dropped (--moe-expert-capacity-factor)"
    if getattr(c, "moe_router_padding_for_quantization", False) or getattr(c, "moe_shared_expert_overlap", False):
        return "routing-map padding or shared-expert overlap is on"
    return None


def apply_device_dispatch(chunks: Iterable[torch.nn.Module]) -> str:
    """Give every MoE layer of `chunks` that fits (see device_dispatch_refusal) the device token dispatcher; after
    apply_grouped_experts. Returns the log line."""
    from megatron_patch.compat.moe import use_token_dispatcher

    kept = []

    def make(layer):
        why = device_dispatch_refusal(layer)
        if why is not None:
            kept.append(why)
            return None
        return DeviceTokenDispatcher(layer.config, layer.config.num_moe_experts, layer.config.moe_router_topk)

    swapped = use_token_dispatcher(chunks, make)
    line = f"MoE dispatch on the device: {swapped} MoE layers sort their tokens by expert without reading counts on " \
           f"the host (static shapes)"
    if kept:
        line += f"; {len(kept)} keep megatron-core's dispatcher ({kept[0]})"
    return line
