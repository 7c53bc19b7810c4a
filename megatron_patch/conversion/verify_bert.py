"""Proof that a BERT conversion kept the model: transformers' BERT and the engine's (any TP/PP layout) run the
same batch, and what both compute must agree, in fp32, within verify.TOLERANCE (1e-4):

- the encoder output (Hugging Face's last hidden state), always;
- the pooler output, when the Hugging Face checkpoint is a bare BertModel with a pooler;
- the MLM logits over the real vocabulary (same top-1 token everywhere) and the NSP logits, when it has
  those heads (BertForMaskedLM / BertForPreTraining); heads it lacks were initialised, nothing to compare.

The batch has two sequences with segment B in their second half; the second one ends in padding
(attention mask 0), so the key-padding mask is exercised. `debug=True` prints each layer's difference."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_patch.training.checkpoint.torch_dist import unwrap

from .verify import TOLERANCE, sample_tokens


def hf_bert_model(hf_dir: str):
    """transformers' class for the tensors of `hf_dir`: BertForPreTraining (MLM and NSP heads), BertForMaskedLM
    (MLM head) or BertModel (with its pooler when the checkpoint has one), in fp32, eval mode."""
    import transformers

    from .hf_io import HFCheckpointReader

    names = set(HFCheckpointReader(hf_dir).keys())
    mlm, nsp = any(n.startswith("cls.predictions.") for n in names), "cls.seq_relationship.weight" in names
    kwargs = {"dtype": torch.float32}
    if mlm and nsp:
        cls = transformers.BertForPreTraining
    elif mlm:
        cls = transformers.BertForMaskedLM
    else:
        cls = transformers.BertModel
        kwargs["add_pooling_layer"] = any(n.endswith("pooler.dense.weight") for n in names)
    return cls.from_pretrained(hf_dir, **kwargs).eval()


def sample_batch(vocab: int, seq: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, token types, attention mask), each [2, seq]."""
    tokens = sample_tokens(vocab, seq)
    types = torch.zeros_like(tokens)
    types[:, seq // 2:] = 1
    mask = torch.ones_like(tokens)
    mask[1, seq - max(1, seq // 4):] = 0
    return tokens, types, mask


def _forward_step(data_iterator, model):
    tokens, types, mask = next(data_iterator)
    output = model(tokens, mask, tokentype_ids=types)

    def collect(output_tensor, non_loss_data=False):
        logits, binary = output_tensor
        return {"logits": tensor_parallel.gather_from_tensor_model_parallel_region(logits), "binary": binary}

    return output, collect


@torch.no_grad()
def engine_outputs(chunks, batch, layers: Optional[Dict[int, torch.Tensor]] = None) -> Optional[Dict[str, torch.Tensor]]:
    """{"hidden" [b, s, h], "pooled" [b, h] or None, "logits" [b, s, padded vocab], "binary" [b, 2] or None} on the
    last pipeline stage (None elsewhere); with `layers`, each local layer's output by global layer index."""
    store: Dict[str, torch.Tensor] = {}
    handles = []
    for c in chunks:
        c.eval()
        m = unwrap(c)
        if m.post_process:
            handles.append(m.encoder.register_forward_hook(
                lambda mod, args, out: store.__setitem__("hidden", out.detach().transpose(0, 1).float().clone())))
            if getattr(m, "pooler", None) is not None:
                handles.append(m.pooler.register_forward_hook(
                    lambda mod, args, out: store.__setitem__("pooled", out.detach().float().clone())))
        for layer in m.encoder.layers if layers is not None else ():
            def hook(module, args, output, number=layer.layer_number):
                hidden = output[0] if isinstance(output, tuple) else output
                layers[number - 1] = hidden.detach().transpose(0, 1).float().clone()
            handles.append(layer.register_forward_hook(hook))
    try:
        n = len(chunks)
        iterator = [iter([batch]) for _ in range(n)] if n > 1 else iter([batch])
        out = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iterator, model=chunks if n > 1 else chunks[0],
            num_microbatches=1, seq_length=batch[0].size(1), micro_batch_size=batch[0].size(0), forward_only=True,
            collect_non_loss_data=True)
    finally:
        for h in handles:
            h.remove()
    if not (mpu.is_pipeline_last_stage(ignore_virtual=True) and out):
        return None
    binary = out[0]["binary"]
    return {"hidden": store["hidden"], "pooled": store.get("pooled"), "logits": out[0]["logits"].float(),
            "binary": None if binary is None else binary.float()}


@torch.no_grad()
def hf_outputs(model, batch) -> Dict[str, Optional[torch.Tensor]]:
    tokens, types, mask = batch
    out = model(input_ids=tokens, token_type_ids=types, attention_mask=mask, output_hidden_states=True)
    logits = getattr(out, "prediction_logits", None)
    return {"hidden": out.hidden_states[-1].float(), "states": out.hidden_states,
            "pooled": getattr(out, "pooler_output", None),
            "logits": logits if logits is not None else getattr(out, "logits", None),
            "binary": getattr(out, "seq_relationship_logits", None)}


def compare(hf: Dict, engine: Dict, vocab: int) -> Dict:
    """max |difference| of each output both sides have, top-1 agreement of the MLM logits, and the verdict."""
    diffs = {}
    for key in ("hidden", "pooled", "logits", "binary"):
        if hf.get(key) is not None and engine.get(key) is not None:
            theirs = engine[key][..., :vocab] if key == "logits" else engine[key]
            diffs[key] = (hf[key].float() - theirs).abs().max().item()
    agree = 1.0
    if "logits" in diffs:
        agree = (hf["logits"].argmax(-1) == engine["logits"][..., :vocab].argmax(-1)).float().mean().item()
    return {"diffs": diffs, "top1_agreement": agree,
            "passed": "hidden" in diffs and all(d <= TOLERANCE for d in diffs.values()) and agree == 1.0}


NAMES = {"hidden": "hidden states", "pooled": "pooler output", "logits": "MLM logits", "binary": "NSP logits"}


def verify_bert(chunks, hf_model, vocab: int, seq: int, debug: bool = False, log=print) -> bool:
    """Run both models on the same batch; True on every rank when they agree (collective)."""
    batch = sample_batch(vocab, seq)
    layers: Optional[Dict[int, torch.Tensor]] = {} if debug else None
    engine = engine_outputs(chunks, batch, layers)
    report, ref = None, None
    if engine is not None and mpu.get_tensor_model_parallel_rank() == 0:
        ref = hf_outputs(hf_model, batch)
        report = compare(ref, engine, vocab)
    if debug:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, layers if mpu.get_tensor_model_parallel_rank() == 0 else {})
        if report is not None:
            merged = {i: t for d in everyone for i, t in d.items()}
            report["layers"] = [f"  layer {i:>3}: max |hidden difference| "
                                f"{(ref['states'][i + 1].float() - merged[i]).abs().max().item():.3e}"
                                for i in sorted(merged)]
    reports: List = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    report = next(r for r in reports if r is not None)
    if dist.get_rank() == 0:
        for line in report.get("layers", []):
            log(line)
        compared = ", ".join(f"{NAMES[k]} {d:.3e}" for k, d in report["diffs"].items())
        verdict = "passed" if report["passed"] else "FAILED"
        log(f"verify {verdict}: max |difference| {compared} (tolerance {TOLERANCE:g}, fp32)"
            + (f", MLM top-1 agreement {100 * report['top1_agreement']:.2f}%" if "logits" in report["diffs"] else "")
            + f" over {batch[0].numel()} positions ({int((batch[2] == 0).sum())} padding)")
        missing = [NAMES[k] for k in ("logits", "binary") if k not in report["diffs"]]
        if missing:
            log(f"verify: not compared: {', '.join(missing)} (a head one of the two models does not have)")
    return report["passed"]
