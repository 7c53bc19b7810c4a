"""One process of tests/test_bert_model.py (run directly for TP1, under torchrun for TP/PP layouts): the engine's
BERT, loaded with --load-hf from each Hugging Face directory given, against transformers' model on the same
padded batch, in fp32. Writes {name: {"diffs": {...}, "top1_agreement": ..., "loss": [engine, hf] or null}}
as JSON (last pipeline stage, TP rank 0).

    python tests/bert_model_worker.py OUT.json --tp T --pp P NAME=HF_DIR [NAME=HF_DIR ...]

The loss check (checkpoints with both heads): the per-token MLM loss the model computes from lm_labels
(padding rows of the vocabulary excluded) combined by models.bert.bert_pretraining_loss, against
BertForPreTraining's loss for the same masked positions and next-sentence labels; then the gradient of every
parameter, after backward through megatron-core's schedule, against transformers' (mapped by the table).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def engine_loss_and_grads(chunks, batch, labels, loss_mask, is_random):
    """bert_pretraining_loss of the engine model on `batch` (last stage; None elsewhere), and its gradients
    (forward and backward through megatron-core's schedule, eval mode: no dropout) left in param.grad."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_patch.models.bert import bert_pretraining_loss

    def step(data_iterator, model):
        tokens, types, mask = next(data_iterator)
        out = model(tokens, mask, tokentype_ids=types, lm_labels=labels)

        def loss_func(output_tensor):
            lm_loss, binary = output_tensor
            loss, _ = bert_pretraining_loss(lm_loss, loss_mask, binary, is_random)
            return loss, {"loss": loss.detach()}
        return out, loss_func

    for c in chunks:
        c.zero_grad(set_to_none=True)
    n = len(chunks)
    out = get_forward_backward_func()(
        forward_step_func=step, data_iterator=[iter([batch]) for _ in range(n)] if n > 1 else iter([batch]),
        model=chunks if n > 1 else chunks[0], num_microbatches=1, seq_length=batch[0].size(1),
        micro_batch_size=batch[0].size(0), forward_only=False)
    return out[0]["loss"].item() if out else None


def grad_difference(chunks, cfg, hf_model, pp: int) -> float:
    """max |engine grad - transformers' grad| over this rank's parameters, the transformers gradients brought to
    megatron-core's layout by the conversion table (and cut to this rank's slice). With PP > 1 the tied word
    embedding's two halves (first and last stage) are summed by the trainer, not here: left out."""
    from megatron_patch.conversion import tables
    from megatron_patch.conversion.mapping import dims, options, to_mcore
    from megatron_patch.models import padded_vocab_size
    from megatron_patch.models.partition import global_name, local_shard

    family = tables.for_model_type("bert")
    grads = {n: p.grad for n, p in hf_model.named_parameters() if p.grad is not None}
    rules = {r.mcore: r for r in family.table.expand(options(cfg), cfg.num_layers)}
    d = dims(cfg, cfg.model_vocab_size, padded_vocab_size(cfg.model_vocab_size, cfg))
    worst = 0.0
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            gname = global_name(name, chunk)
            if pp > 1 and gname == "embedding.word_embeddings.weight":
                continue
            want = local_shard(to_mcore(rules[gname], lambda h: grads[h], d), p, gname, False)
            worst = max(worst, float("inf") if p.grad is None else (p.grad - want).abs().max().item())  # unused: inf
    return worst


def check(name: str, hf_dir: str, tp: int, pp: int) -> dict:
    from megatron.core import parallel_state as mpu

    from megatron_patch.conversion.hf_source import build_model, parse_args
    from megatron_patch.conversion.verify_bert import compare, engine_outputs, hf_bert_model, hf_outputs, sample_batch
    from megatron_patch.models import padded_vocab_size

    cfg = parse_args(["--load-hf", hf_dir, "--mock-data", "--micro-batch-size", "2", "--train-iters", "1",
                      "--eval-iters", "0", "--tensor-model-parallel-size", str(tp),
                      "--pipeline-model-parallel-size", str(pp), "--make-vocab-size-divisible-by", "8",
                      "--seq-length", "24"])
    chunks = build_model(cfg, cfg.model_vocab_size, for_training=False)
    batch = sample_batch(cfg.model_vocab_size, cfg.seq_length)
    engine = engine_outputs(chunks, batch)
    hf = hf_bert_model(hf_dir)
    # masked positions: every third real token; labels elsewhere are ignored (-100 for transformers)
    g = torch.Generator().manual_seed(1)
    loss_mask = ((torch.arange(batch[0].numel()).view_as(batch[0]) % 3 == 0) & (batch[2] == 1)).long()
    labels = torch.randint(0, cfg.model_vocab_size, batch[0].shape, generator=g)
    is_random = torch.tensor([0, 1])
    result = {}
    if hasattr(hf, "cls") and hasattr(hf.cls, "seq_relationship"):  # both heads: the loss and every gradient
        import torch.distributed as dist

        ours = engine_loss_and_grads(chunks, batch, labels, loss_mask, is_random)
        tokens, types, mask = batch
        theirs = hf(input_ids=tokens, token_type_ids=types, attention_mask=mask,
                    labels=torch.where(loss_mask.bool(), labels, -100), next_sentence_label=is_random).loss
        theirs.backward()
        worst = torch.tensor(grad_difference(chunks, cfg, hf, cfg.pipeline_model_parallel_size))
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        result.update(loss=[ours, theirs.item()], grad_max_diff=worst.item())
    if engine is None or mpu.get_tensor_model_parallel_rank() != 0:
        return {}
    result.update(compare(hf_outputs(hf, batch), engine, cfg.model_vocab_size))
    result["padded_vocab"] = padded_vocab_size(cfg.model_vocab_size, cfg)
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("models", nargs="+", help="NAME=HF_DIR")
    a = p.parse_args()
    from megatron_patch.conversion.hf_source import parse_args
    from megatron_patch.parallel import destroy, initialize

    first = a.models[0].split("=", 1)[1]
    initialize(parse_args(["--load-hf", first, "--mock-data", "--micro-batch-size", "2", "--train-iters", "1",
                           "--eval-iters", "0", "--tensor-model-parallel-size", str(a.tp),
                           "--pipeline-model-parallel-size", str(a.pp), "--seq-length", "24"]))
    results = {}
    for spec in a.models:
        name, hf_dir = spec.split("=", 1)
        r = check(name, hf_dir, a.tp, a.pp)
        if r:
            results[name] = r
    if results:
        with open(a.out, "w") as f:
            json.dump(results, f)
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
