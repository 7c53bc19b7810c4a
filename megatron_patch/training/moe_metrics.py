"""Per-iteration Mixture-of-Experts metrics: the routers' auxiliary losses and the tokens each expert received.

megatron-core's routers record their auxiliary losses in its metrics tracker
(megatron/core/transformer/moe/moe_logging.py: `get_moe_metrics_tracker().record(...)` in
TopKRouter.attach_and_log_load_balancing_loss and apply_z_loss; the deprecated `moe_utils.track_moe_metrics`
/ `get_moe_layer_wise_logging_tracker` wrap the same tracker): one value per layer, summed over the micro
batches of a step, each divided by its coefficient. `report()` reduces it over PP / TP / DP as Megatron-LM's
training loop does, then clears it, all on the device (compat/moe.py moe_tracked_means: upstream's report also
formats a log string, which reads every value on the host). megatron-core does not track how many tokens each expert receives (only
its expert-bias router keeps a count); a forward hook on each router adds that.
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.router import Router

from megatron_patch.compat.moe import moe_tracked_means, tracker_tensors_before_capture
from megatron_patch.config import Config
from megatron_patch.parallel import current_device


def _tracked_names(cfg: Config) -> List[str]:
    """The tracker's names for the losses this configuration computes (Megatron-LM's training_log)."""
    names = []
    if cfg.moe_aux_loss_coeff > 0:
        names += {"aux_loss": ["load_balancing_loss"], "seq_aux_loss": ["seq_load_balancing_loss"],
                  "global_aux_loss": ["global_load_balancing_loss"]}.get(cfg.moe_router_load_balancing_type, [])
    if cfg.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


class MoEMetrics:
    """Counts routed tokens per (layer, expert) in training-mode forwards; `report()` once per step."""

    def __init__(self, cfg: Config, model) -> None:
        self.cfg = cfg
        # On the device the routers run on: the counts add up there without a host sync, and NCCL reduces them.
        self.counts = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.int64, device=current_device())
        self._layers = torch.tensor(cfg.moe_layers(), device=current_device())  # the MoE layers' rows of counts
        # Created now, not at the first record(): compiled layers with CUDA graphs add into them in place.
        tracker_tensors_before_capture(get_moe_metrics_tracker(), _tracked_names(cfg), cfg.num_layers,
                                       current_device(), extra=[self.counts])
        for chunk in model:
            for module in chunk.modules():
                if isinstance(module, Router):
                    module.register_forward_hook(self._count)

    def _count(self, router, inputs, output) -> None:
        # Grad mode: a recomputed forward (activation checkpointing) counts once, in backward, as the
        # aux losses do.
        if router.training and torch.is_grad_enabled() and router.layer_number is not None:
            _, routing_map = output  # [tokens, experts] bool: which experts each token goes to (after dropping)
            self.counts[router.layer_number - 1] += routing_map.sum(dim=0)

    def report(self, num_microbatches: int, iteration: int) -> Dict[str, object]:
        """This step's metrics, identical on every rank, as tensors on the device (the training loop reads them
        with the step's other metrics, once the next step is queued: no host wait here); clears the counts and
        megatron-core's tracker.

        moe_<name>: the mean over MoE layers of each tracked auxiliary loss (without its coefficient),
        averaged over micro batches and data-parallel ranks; moe_tokens_per_expert: [layer][expert] tokens
        routed in this global batch (all micro batches and DP ranks; dense layers omitted);
        moe_max_load: the busiest expert's share over the mean share, the worst MoE layer (1 = balanced)."""
        cfg = self.cfg
        names = _tracked_names(cfg)
        totals = moe_tracked_means(get_moe_metrics_tracker(), names, 1 / num_microbatches, cfg.num_layers,
                                   cfg.moe_layer_freq) if names else {}
        out: Dict[str, object] = {f"moe_{k}": v for k, v in totals.items()}
        counts = self.counts
        if not cfg.sequence_parallel and mpu.get_tensor_model_parallel_rank() != 0:
            counts = torch.zeros_like(counts)  # without sequence parallelism every TP rank routes the same tokens
        # Routers are replicated over DP (expert parallelism is carved out of DP) and split over PP stages.
        counts = counts.clone()
        dist.all_reduce(counts)
        per_layer = counts.index_select(0, self._layers)  # (a list index would copy itself to the GPU every step)
        out["moe_tokens_per_expert"] = per_layer
        mean = per_layer.double().mean(dim=1).clamp(min=1)
        out["moe_max_load"] = (per_layer.max(dim=1).values / mean).max()
        self.counts.zero_()
        return out

    @staticmethod
    def clear() -> None:
        """Forget what forwards outside training steps (evaluation) recorded."""
        get_moe_metrics_tracker().clear()
