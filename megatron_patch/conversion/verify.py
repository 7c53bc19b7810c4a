"""Proof that a conversion kept the model: the Hugging Face model and the engine's model (in whatever
TP/PP layout it was built) run the same token batches, and their logits must agree.

Criterion: max |logit difference| <= 1e-4 over every position of every batch row and the real vocabulary
(the padding rows excluded), and the same top-1 token at every position. Both sides run in
fp32 (bf16 weights are exactly representable there), so the criterion is the same for bf16 checkpoints.
`debug=True` also prints the difference after every transformer layer."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_patch.training.checkpoint.torch_dist import unwrap


TOLERANCE = 1e-4


def sample_tokens(vocab: int, seq: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)
    positions = torch.arange(tokens.size(1)).unsqueeze(0).expand_as(tokens)
    output = model(tokens, positions, None)

    def collect(output_tensor, non_loss_data=False):
        return tensor_parallel.gather_from_tensor_model_parallel_region(output_tensor)  # the whole vocabulary

    return output, collect


def _layer_hooks(chunks, store: Dict[int, torch.Tensor]) -> List:
    handles = []
    for chunk in chunks:
        for layer in unwrap(chunk).decoder.layers:
            def hook(module, args, output, number=layer.layer_number):
                hidden = output[0] if isinstance(output, tuple) else output
                store[number - 1] = hidden.detach().transpose(0, 1).float().clone()  # [b, s, h]
            handles.append(layer.register_forward_hook(hook))
    return handles


@torch.no_grad()
def engine_logits(chunks, tokens: torch.Tensor, layers: Optional[Dict[int, torch.Tensor]] = None) -> Optional[torch.Tensor]:
    """Logits [b, s, padded vocab] of the engine model on the last pipeline stage (None elsewhere); with
    `layers`, each local transformer layer's output is stored there by global layer index."""
    for c in chunks:
        c.eval()
    handles = _layer_hooks(chunks, layers) if layers is not None else []
    try:
        n = len(chunks)
        iterator = [iter([tokens]) for _ in range(n)] if n > 1 else iter([tokens])
        out = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iterator, model=chunks if n > 1 else chunks[0],
            num_microbatches=1, seq_length=tokens.size(1), micro_batch_size=tokens.size(0), forward_only=True,
            collect_non_loss_data=True)
    finally:
        for h in handles:
            h.remove()
    return out[0].float() if mpu.is_pipeline_last_stage(ignore_virtual=True) and out else None


@torch.no_grad()
def hf_logits(model, tokens: torch.Tensor, hidden: bool = False):
    out = model(input_ids=tokens, output_hidden_states=hidden)
    return out.logits.float(), (out.hidden_states if hidden else None)


def compare(hf: torch.Tensor, engine: torch.Tensor, vocab: int) -> Dict[str, float]:
    """max |difference| over the real vocabulary and the share of positions whose top-1 token agrees."""
    engine = engine[..., :vocab]
    diff = (hf - engine).abs().max().item()
    agree = (hf.argmax(-1) == engine.argmax(-1)).float().mean().item()
    return {"max_abs_diff": diff, "top1_agreement": agree, "passed": diff <= TOLERANCE and agree == 1.0}


def verify(chunks, hf_model, vocab: int, seq: int, debug: bool = False, log=print) -> bool:
    """Run both models on the same batches; True on every rank when they agree (collective)."""
    tokens = sample_tokens(vocab, seq)
    layers: Dict[int, torch.Tensor] = {} if debug else None
    logits = engine_logits(chunks, tokens, layers)
    report = None
    if logits is not None and mpu.get_tensor_model_parallel_rank() == 0:
        ref, hidden = hf_logits(hf_model, tokens, hidden=debug)
        report = compare(ref, logits, vocab)
    if debug:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {i: t for i, t in layers.items()} if mpu.get_tensor_model_parallel_rank() == 0 else {})
        if report is not None:
            merged = {i: t for d in everyone for i, t in d.items()}
            # hidden[i + 1] is layer i's output, except the last one, which Hugging Face gives after the final norm
            report["layers"] = [f"  layer {i:>3}: max |hidden difference| "
                                f"{(hidden[i + 1].float() - merged[i]).abs().max().item():.3e}"
                                for i in sorted(merged) if i + 1 < len(hidden) - 1]
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    report = next(r for r in reports if r is not None)
    if dist.get_rank() == 0:
        for line in report.get("layers", []):
            log(line)
        verdict = "passed" if report["passed"] else "FAILED"
        log(f"verify {verdict}: max |logit difference| {report['max_abs_diff']:.3e} (tolerance {TOLERANCE:g}, fp32), "
            f"top-1 agreement {100 * report['top1_agreement']:.2f}% over {tokens.numel()} positions")
    return report["passed"]
