"""The Finetuner's loop on 1 worker (in this process) and on 2 gloo workers (one spawn for both cases):

- gradient accumulation is exactly a bigger batch: a white-box Finetuner (tiny BERT classifier, dropout off,
  fp32, plain SGD, which unlike Adam is not scale-invariant, and no clipping) trained 3 steps of 8 samples as
  one micro batch of 8, as 2 x 4 accumulated on one worker and as 2 x 2 accumulated on each of 2 workers (DDP,
  and ZeRO-3 with the user's SGD rebuilt over FSDP2's shards): the same losses, gradient norms (as the optimizer sees them) and weights within 1e-5. The sampler's order is the
  same permutation in every case, so step k sees the same 8 samples.
- evaluation covers exactly the validation split, each sample once and in order: 13 samples (a last partial
  batch at micro batch 4, and one sampler repeat with 2 workers). The white-box run records the sample ids it
  gathered; the black-box `--task sequence_classification` run records the token ids it gathered, compared
  with the validation (and test) rows tokenized here, and its accuracy and F1 equal scikit-learn's on this
  file's own predictions from the saved model (the 2-worker run under ZeRO-3: evaluation through FSDP2 and
  the gathered save). `--task causal_lm` on 2 workers: its loss is the mean next-token cross-entropy over
  every validation token, computed here from the saved model.
- data order: the same white-box Finetuner run 2 epochs on 23 training rows (1 worker here, 2 in the spawn)
  records the ids it trained on: each epoch covers the training set once (the sampler's one repeat aside) and
  the second epoch's order differs from the first (the sampler's set_epoch); about 3 s of the budget.

Budget: about 40 s of CPU in all (the spawn of 2 workers importing transformers is much of it).
"""
from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_utils import free_port  # noqa: E402
from finetune_utils import tiny_model  # noqa: E402

N_TRAIN, N_VALID, N_TEST, SEQ, VOCAB = 24, 13, 5, 10, 64
MAX_LENGTH = 48  # --seq-length of the black-box runs
TOL = 1e-5
# white-box runs: (workers, micro batch); --global-batch-size 8 always, so accumulation 8 / (micro x workers)
WHITE = {"one_batch": (1, 8), "accum_1w": (1, 4), "accum_2w": (2, 2)}
# the reshuffle between epochs: 2 epochs of an odd training set (2 workers: one sampler repeat per epoch)
EPOCHS = dict(length=("--epochs", "2"), n_train=N_TRAIN - 1)
WHITE_RECORDS = ["one_batch", "accum_1w", "accum_2w", "accum_2w_rank1", "accum_2w_zero3", "accum_2w_zero3_rank1"]


# ---------------------------------------------------------------- the white-box Finetuner

class RecordingSGD(torch.optim.SGD):
    """Plain SGD that records the global gradient norm it is asked to apply (the Finetuner clips nothing here).
    `last` is the newest instance: under ZeRO-3 accelerate() rebuilds the user's optimizer over the shards."""

    last = None

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.norms = []
        RecordingSGD.last = self

    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        grads = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]  # FSDP2 shards: gathered
        norms = [torch.linalg.vector_norm(g) for g in grads]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0)  # 0: no gradients
        return super().step(closure)


def _rows(n: int, first_id: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [{"idx": torch.tensor(first_id + i), "input_ids": torch.randint(1, VOCAB, (SEQ,), generator=g),
             "labels": torch.randint(0, 2, (), generator=g)} for i in range(n)]


def _tiny_classifier():
    import transformers

    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def _whitebox_class(n_train: int = N_TRAIN):
    from megatron_patch.templates.finetuner import Finetuner

    class WhiteBox(Finetuner):
        """Train rows have ids 1000+, validation rows 0..12: what an evaluation gathered shows which split it read.
        `trained` lists the ids of each training batch, `epoch_ends` how many there were at each evaluation."""

        def train_valid_test_datasets_provider(self):
            self.losses, self.evaluations, self.trained, self.epoch_ends = [], [], [], []
            return _rows(n_train, 1000, 1), _rows(N_VALID, 0, 2), None, torch.utils.data.default_collate

        def model_optimizer_lr_scheduler_provider(self):
            model = _tiny_classifier()
            return model, RecordingSGD(model.parameters(), lr=self.args.lr), None

        def run_forward_step(self, batch, model):
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            self.losses.append(loss.item())
            self.trained.append(batch["idx"].tolist())
            return loss

        def run_compute_metrics(self, model, eval_dataloader):
            self.epoch_ends.append(len(self.trained))
            ids, predictions, labels = [], [], []
            for batch in eval_dataloader:
                logits = model[0](input_ids=batch["input_ids"]).logits
                ids += self.gather(batch["idx"]).tolist()
                predictions += self.gather(logits.argmax(-1)).tolist()
                labels += self.gather(batch["labels"]).tolist()
            self.evaluations.append({"ids": ids, "predictions": predictions, "labels": labels})
            return {"accuracy": sum(p == l for p, l in zip(predictions, labels)) / len(labels)}

    return WhiteBox


def _whitebox(world: int, micro: int, *extra: str, length=("--train-iters", "3"), n_train: int = N_TRAIN) -> dict:
    from megatron_patch.config.rapidformer_flags import parse_args
    from megatron_patch.templates.rules import check
    from megatron_patch.templates.engine import RapidformerEngine

    # --user-script names this file only to pass the front end's rules: the class above is the user's Finetuner
    argv = ["--user-script", os.path.abspath(__file__), "--micro-batch-size", str(micro), "--global-batch-size", "8",
            *length, "--lr", "0.5", "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
            "--clip-grad", "0", "--weight-decay", "0", "--seed", "7", "--eval-at-start", *extra]
    args = check(parse_args(argv), world_size=world)
    tuner = _whitebox_class(n_train)(RapidformerEngine(args))
    metrics = tuner.train()
    from megatron_patch.templates.saving import full_state_dict

    # the whole model on rank 0 (FSDP2 shards gathered); other ranks record none
    weights = full_state_dict(tuner.model) if dist.is_initialized() else tuner.model.state_dict()
    return {"accumulation": args.grad_accumulation, "losses": tuner.losses, "norms": RecordingSGD.last.norms,
            "metrics": metrics, "evaluations": tuner.evaluations,
            "epochs": [sum(tuner.trained[a:b], []) for a, b in zip(tuner.epoch_ends, tuner.epoch_ends[1:])],
            "weights": {k: v.tolist() for k, v in weights.items()} or None}


# ---------------------------------------------------------------- the black-box task, recording what it evaluated

def _blackbox(task: str, data: str, model: str, save: str, *extra: str) -> dict:
    from megatron_patch.config.rapidformer_flags import parse_args
    from megatron_patch.templates.rules import check
    from megatron_patch.cli.tasks import task_class
    from megatron_patch.templates.engine import RapidformerEngine

    class Recorded(task_class(task)):
        """The task unchanged; each evaluation's batches are also gathered here, to see which rows it read."""

        def __init__(self, engine):
            super().__init__(engine)
            self.evaluated = []

        def metrics(self, model, loader):
            rows = []

            def passing():
                for batch in loader:
                    rows.extend(self.gather(batch["input_ids"]).tolist())
                    yield batch

            out = super().metrics(model, passing())
            self.evaluated.append(rows)
            return out

    world = dist.get_world_size() if dist.is_initialized() else 1
    argv = ["--task", task, "--pretrained-model-name-or-path", model, "--data-path", data, "--micro-batch-size", "4",
            "--epochs", "1", "--lr", "1e-3", "--seq-length", str(MAX_LENGTH), "--eval-at-start", "--save", save, *extra]
    args = check(parse_args(argv), world_size=world)
    recorded = Recorded(RapidformerEngine(args))
    recorded.train()
    return {"evaluated": recorded.evaluated}


# ---------------------------------------------------------------- running: 1 worker here, 2 workers spawned

def _two_workers(rank: int, port: int, tmp: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    torch.set_num_threads(1)
    try:
        world, micro = WHITE["accum_2w"]
        result = {"white": _whitebox(world, micro),
                  # FSDP2's accumulation: gradient sync off (set_requires_gradient_sync) but the last micro batch
                  "white_zero3": _whitebox(world, micro, "--zero-3-memory-optimization"),
                  "white_epochs": _whitebox(world, micro, **EPOCHS),
                  # under ZeRO-3: evaluation through FSDP2, and save_pretrained gathers the shards
                  "black": _blackbox("sequence_classification", f"{tmp}/data", f"{tmp}/model", f"{tmp}/save2",
                                     "--zero-3-memory-optimization"),
                  "lm": _blackbox("causal_lm", f"{tmp}/lm_data", f"{tmp}/gpt2", f"{tmp}/lm_save2")}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_patch.demo.task_files import write_task_dataset

    tmp = tmp_path_factory.mktemp("finetuner")
    data = write_task_dataset("sequence_classification", str(tmp / "data"), n_train=32, n_valid=N_VALID,
                              n_test=N_TEST)
    model = tiny_model("bert", str(tmp / "model"))
    write_task_dataset("causal_lm", str(tmp / "lm_data"), n_train=16, n_valid=N_VALID)
    tiny_model("gpt2", str(tmp / "gpt2"))
    out = str(tmp / "two")
    mp.start_processes(_two_workers, args=(free_port(), str(tmp), out), nprocs=2, start_method="spawn")
    two = [json.load(open(f"{out}.{r}")) for r in range(2)]
    assert "WORLD_SIZE" not in os.environ or os.environ["WORLD_SIZE"] == "1"
    white = {name: _whitebox(w, m) for name, (w, m) in WHITE.items() if w == 1}
    white["accum_2w"] = two[0]["white"]
    white["accum_2w_rank1"] = two[1]["white"]
    white["accum_2w_zero3"] = two[0]["white_zero3"]
    white["accum_2w_zero3_rank1"] = two[1]["white_zero3"]
    epochs = {1: [_whitebox(1, 4, **EPOCHS)["epochs"]], 2: [two[r]["white_epochs"]["epochs"] for r in range(2)]}
    black = {1: (_blackbox("sequence_classification", data, model, str(tmp / "save1")), tmp / "save1"),
             2: (two[0]["black"], tmp / "save2")}
    return {"white": white, "epochs": epochs, "black": black, "data": data, "lm": (two[0]["lm"], tmp / "lm_save2", tmp / "lm_data")}


def _close(a, b, what):
    assert len(a) == len(b), (what, a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= TOL * max(1.0, abs(y)), (what, a, b)


def _step_losses(micro_losses, accumulation):
    return [sum(micro_losses[i:i + accumulation]) / accumulation for i in range(0, len(micro_losses), accumulation)]


# ---------------------------------------------------------------- gradient accumulation

def test_accumulation_trains_like_one_big_batch(runs):
    white = runs["white"]
    ref = white["one_batch"]
    assert ref["accumulation"] == 1 and white["accum_1w"]["accumulation"] == 2 and white["accum_2w"]["accumulation"] == 2
    assert len(ref["norms"]) == 3 and len(ref["losses"]) == 3
    one = white["accum_1w"]
    _close(_step_losses(one["losses"], 2), ref["losses"], "losses, 1 worker x 2 micro batches")
    for two_workers in ("accum_2w", "accum_2w_zero3"):
        two = [_step_losses(white[k]["losses"], 2) for k in (two_workers, f"{two_workers}_rank1")]
        _close([(a + b) / 2 for a, b in zip(*two)], ref["losses"], f"losses, {two_workers}")
    assert white["accum_2w_zero3"]["accumulation"] == 2
    for name in WHITE_RECORDS[1:]:
        _close(white[name]["norms"], ref["norms"], f"gradient norms, {name}")
        if white[name]["weights"] is None:  # rank 1: the whole model is gathered on rank 0
            continue
        for key, w in ref["weights"].items():
            torch.testing.assert_close(torch.tensor(white[name]["weights"][key]), torch.tensor(w), rtol=TOL, atol=TOL,
                                       msg=lambda m, key=key, name=name: f"{name} {key}: {m}")
    start = _tiny_classifier().state_dict()["classifier.weight"]
    assert not torch.allclose(torch.tensor(ref["weights"]["classifier.weight"]), start, atol=1e-3)  # it trained


# ---------------------------------------------------------------- evaluation: what is evaluated

@pytest.mark.parametrize("name", WHITE_RECORDS)
def test_whitebox_evaluation_reads_each_validation_sample_once(runs, name):
    rec = runs["white"][name]
    if rec["weights"] is None:  # rank 1: gathered the same as rank 0
        rec = dict(rec, weights=runs["white"][name.replace("_rank1", "")]["weights"])
    assert len(rec["evaluations"]) == 2  # --eval-at-start, then after the (only) epoch
    for ev in rec["evaluations"]:
        assert ev["ids"] == list(range(N_VALID)), ev["ids"]
        labels = [int(r["labels"]) for r in _rows(N_VALID, 0, 2)]
        assert ev["labels"] == labels
    # the final evaluation's predictions are the final weights' own, computed here in one batch
    model = _tiny_classifier()
    model.load_state_dict({k: torch.tensor(v) for k, v in rec["weights"].items()})
    with torch.no_grad():
        ids = torch.stack([r["input_ids"] for r in _rows(N_VALID, 0, 2)])
        mine = model.eval()(input_ids=ids).logits.argmax(-1).tolist()
    assert rec["evaluations"][-1]["predictions"] == mine
    from sklearn.metrics import accuracy_score

    assert rec["metrics"]["accuracy"] == pytest.approx(accuracy_score(labels, mine), abs=1e-12)


def _tokenized(data: str, split: str, tokenizer):
    rows = [json.loads(line) for line in open(os.path.join(data, f"{split}.jsonl"))]
    return rows, [tokenizer(r["sentence1"], r["sentence2"], truncation=True, max_length=MAX_LENGTH)
                  for r in rows]


def _strip(row):
    while row and row[-1] in (-100, 0):  # gather's width padding, then the collator's [PAD] (id 0)
        row = row[:-1]
    return row


@pytest.mark.parametrize("workers", [1, 2])
def test_task_evaluates_exactly_the_validation_split(runs, workers):
    """What `--task sequence_classification` evaluated: before training and after the epoch the 13 validation
    rows, then the 5 test rows, each once and in order; and its reported accuracy and F1 are scikit-learn's on
    the predictions of the saved model computed here, one row at a time."""
    import transformers
    from sklearn.metrics import accuracy_score, f1_score

    rec, save = runs["black"][workers]
    tok = transformers.AutoTokenizer.from_pretrained(str(save))
    valid_rows, valid_ids = _tokenized(runs["data"], "validation", tok)
    _, test_ids = _tokenized(runs["data"], "test", tok)
    assert len(valid_ids) == N_VALID and len(test_ids) == N_TEST
    got = [[_strip(r) for r in ev] for ev in rec["evaluated"]]
    expected = [[e["input_ids"] for e in split] for split in (valid_ids, valid_ids, test_ids)]
    assert got == expected, [len(g) for g in got]

    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(save)).eval()
    names = json.load(open(os.path.join(runs["data"], "label_names.json")))["label"]
    assert [model.config.id2label[i] for i in range(len(names))] == names
    with torch.no_grad():
        predictions = [int(model(**{k: torch.tensor([v]) for k, v in enc.items()}).logits.argmax(-1))
                       for enc in valid_ids]
    labels = [r["label"] for r in valid_rows]
    lines = [json.loads(line) for line in open(save / "metrics.jsonl")]
    last = [l for l in lines if l["split"] == "validation"][-1]
    assert last["accuracy"] == pytest.approx(accuracy_score(labels, predictions), abs=1e-12), (last, predictions)
    assert last["f1"] == pytest.approx(f1_score(labels, predictions, zero_division=0), abs=1e-12), (last, predictions)


def test_causal_lm_perplexity_is_over_every_validation_token_once(runs):
    """`--task causal_lm` on 2 workers: it evaluated the 13 validation rows once each, in order, and its loss is
    the mean next-token cross-entropy over all their tokens, computed here from the saved model row by row."""
    import transformers

    rec, save, data = runs["lm"]
    tok = transformers.AutoTokenizer.from_pretrained(str(save))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(save)).eval()
    rows = [json.loads(line)["text"] for line in open(os.path.join(str(data), "validation.jsonl"))]
    ids = [tok(t, truncation=True, max_length=MAX_LENGTH, return_token_type_ids=False)["input_ids"] for t in rows]
    assert [[_strip(r) for r in ev] for ev in rec["evaluated"]] == [ids, ids]
    total = count = 0.0
    with torch.no_grad():
        for row in ids:
            logits = model(input_ids=torch.tensor([row])).logits[0, :-1].double()
            total += float(torch.nn.functional.cross_entropy(logits, torch.tensor(row[1:]), reduction="sum"))
            count += len(row) - 1
    last = [l for l in (json.loads(x) for x in open(save / "metrics.jsonl")) if l["split"] == "validation"][-1]
    assert last["loss"] == pytest.approx(total / count, rel=1e-5), (last, total / count)
    assert last["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)


# ---------------------------------------------------------------- data order: every epoch, a new permutation

@pytest.mark.parametrize("workers", [1, 2])
def test_each_epoch_reads_every_training_sample_once_in_a_new_order(runs, workers):
    """2 epochs of 23 training rows: in each epoch the workers' batches together hold every row once (with 2
    workers one row twice: the sampler's repeat that evens the shares); the order is shuffled and the second
    epoch's differs from the first on every worker (the sampler's set_epoch)."""
    per_rank = runs["epochs"][workers]
    n = EPOCHS["n_train"]
    everything = list(range(1000, 1000 + n))
    assert all(len(epochs) == 2 for epochs in per_rank), per_rank
    for epoch in range(2):
        seen = sorted(sum((epochs[epoch] for epochs in per_rank), []))
        assert sorted(set(seen)) == everything, (epoch, seen)
        assert len(seen) == n + (-n) % workers, (epoch, seen)  # repeats: only the sampler's padding
    for epochs in per_rank:
        assert epochs[0] != epochs[1], epochs
        assert epochs[0] != sorted(epochs[0]) and epochs[1] != sorted(epochs[1]), epochs  # shuffled
