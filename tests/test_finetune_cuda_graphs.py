"""`--torch-compile-mode reduce-overhead` in the Finetuner loop, on a GPU: the compiled forward and backward are
replayed as CUDA graphs, and training must match the eager loop step for step.

What CUDA graphs can break, and what each check catches:
- a replay overwrites the previous step's outputs: the loss the reporter averages over --log-interval steps
  (it must keep a copy) -> the logged losses are compared with eager's;
- the step boundary (`mark_step`): a missing one makes the graph runtime refuse to replay or re-record;
- evaluation holds every batch's logits until the end (as metric code does): it runs eagerly, else a
  replay overwrites the earlier batches' logits -> the evaluation loss is compared with eager's;
- graphs actually recorded (not silently skipped) -> the graph tree is non-empty and nothing was skipped.
Dropout is off (compiled and eager dropout draw different random numbers); fp32, so the tolerances are tight.
"""
from __future__ import annotations

import logging
import re

import pytest
import torch

pytestmark = pytest.mark.gpu
STEPS, BATCH = 12, 8


def _dataset(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(5, 41, (), generator=g))
        ids = torch.randint(5, 500, (k,), generator=g)
        out.append({"input_ids": ids, "labels": int(ids[1] % 2)})
    return out


def _collate(multiple: int):
    def collate(samples):
        n = -(-max(len(s["input_ids"]) for s in samples) // multiple) * multiple
        ids = torch.zeros(len(samples), n, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(samples):
            ids[i, :len(s["input_ids"])], mask[i, :len(s["input_ids"])] = s["input_ids"], 1
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([s["labels"] for s in samples])}
    return collate


def _run(extra):
    import transformers

    from megatron_patch.config.rapidformer_flags import parse_args
    from megatron_patch.templates.rules import check
    from megatron_patch.templates import Finetuner, RapidformerEngine
    from megatron_patch.templates.globals import get_logger, set_args

    torch._dynamo.reset()
    argv = ["--user-script", __file__, "--micro-batch-size", str(BATCH), "--train-iters", str(STEPS), "--lr", "1e-3",
            "--seed", "3", "--log-interval", "3", "--pad-to-multiple-of", "16", *extra]
    args = check(parse_args(argv), world_size=1)
    set_args(args)
    engine = RapidformerEngine(args)
    assert engine.device.type == "cuda"
    train, valid = _dataset(STEPS * BATCH, 1), _dataset(40, 2)
    rec = {"losses": [], "eval": None}

    class Tune(Finetuner):
        def train_valid_test_datasets_provider(self):
            return train, valid, None, _collate(args.pad_to_multiple_of)

        def model_optimizer_lr_scheduler_provider(self):
            torch.manual_seed(0)
            cfg = transformers.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
            return transformers.BertForSequenceClassification(cfg), None, None

        def run_forward_step(self, batch, model):
            loss = model(**batch).loss
            rec["losses"].append(loss.detach().clone())
            return loss

        def run_compute_metrics(self, model, eval_dataloader):
            logits, labels = [], []
            for batch in eval_dataloader:
                logits.append(model[0](**batch).logits)  # held until the end, as metric code does
                labels.append(batch["labels"])
            loss = torch.nn.functional.cross_entropy(torch.cat(logits).float(), torch.cat(labels))
            return {"loss": float(loss)}

    lines = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    get_logger().addHandler(handler)
    try:
        metrics = Tune(engine).train()
    finally:
        get_logger().removeHandler(handler)
    rec["eval"] = metrics["loss"]
    rec["logged"] = [float(m.group(1)) for m in (re.search(r"\| loss ([0-9.]+) \|", x) for x in lines) if m]
    rec["applied"] = [x for x in lines if x.startswith("acceleration: torch.compile")]
    rec["losses"] = torch.stack(rec["losses"]).cpu().tolist()
    if extra:
        from torch._dynamo.utils import counters
        from torch._inductor.cudagraph_trees import get_manager

        manager = get_manager(engine.device.index or 0, create_if_none_exists=False)
        rec["graph_roots"] = sum(len(v) for v in manager.roots.values()) if manager is not None else 0
        rec["skips"] = counters["inductor"]["cudagraph_skips"]
    return rec


def test_cuda_graphs_train_like_eager():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    eager = _run([])
    graphs = _run(["--torch-compile-mode", "reduce-overhead"])
    assert "CUDA graphs per batch shape" in graphs["applied"][0], graphs["applied"]
    assert graphs["graph_roots"] > 0 and graphs["skips"] == 0, graphs
    assert len(graphs["losses"]) == len(eager["losses"]) == STEPS
    assert graphs["losses"] == pytest.approx(eager["losses"], rel=1e-4)
    assert len(graphs["logged"]) == len(eager["logged"]) == STEPS // 3
    assert graphs["logged"] == pytest.approx(eager["logged"], rel=1e-3)  # printed with 4 decimals
    assert graphs["eval"] == pytest.approx(eager["eval"], rel=1e-4)
