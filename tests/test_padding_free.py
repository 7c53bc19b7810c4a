"""`--padding-free` (issue 31): fine-tuning on packed rows must compute what the padded run computes.

- the packed forward of a BERT classifier (random weights from a config, fp32, dropout off) gives the padded
  forward's per-sample logits (sequence classification) or per-token logits (token classification), its loss and
  its gradients within 1e-5, with the sdpa and the eager attention; padded batches through the same model still
  give the padded results (evaluation stays padded); the packed forward applies attention dropout;
- the collator's layout: samples in order, positions restarting per sample, token types per token, segment
  bounds, a filler segment up to the token budget (empty when the tokens fill it), per-token labels -100 on the
  filler; bad batches (left padding, a key it cannot pack, a sample longer than the model's positions) are
  refused in words;
- the Finetuner (white box) and `--task sequence_classification` (black box) train with the padded run's losses
  step for step (same samples, same order; gradient accumulation included) and the same validation metrics;
- the flag where it cannot act is refused with a sentence: other tasks, pretraining, ONNX Runtime, a model family
  or head without an adapter.
The 2-worker (gloo, DDP) black-box run is in the slow lane; the GPU kernels in tests/test_padding_free_gpu.py.
"""
from __future__ import annotations

import copy
import logging
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_utils import explain, rapidformer, tiny_model  # noqa: E402

TOL = 1e-5
LENGTHS = (7, 19, 3, 30, 11, 1, 24)  # one single-token sample; 95 tokens in all


def _config(attn: str = "sdpa", **kw):
    import transformers

    values = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=64, type_vocab_size=2, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, num_labels=3, attn_implementation=attn)
    values.update(kw)
    return transformers.BertConfig(**values)


def _samples(lengths=LENGTHS, seed: int = 0, per_token: bool = False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(5, 300, (n,), generator=g)
        types = (torch.arange(n) >= n // 2).long()  # a sentence pair: the second half has token type 1
        label = torch.randint(0, 3, (n,), generator=g) if per_token else int(torch.randint(0, 3, (), generator=g))
        if per_token:
            label[0] = -100  # [CLS]: no tag, as the task's labelling does
        out.append({"input_ids": ids, "token_type_ids": types, "labels": label})
    return out


def _pad(samples, multiple: int = 1):
    """Right padding, as DataCollatorWithPadding pads (labels per token padded with -100)."""
    width = -(-max(len(s["input_ids"]) for s in samples) // multiple) * multiple
    n = len(samples)
    ids, types, mask = (torch.zeros(n, width, dtype=torch.long) for _ in range(3))
    per_token = torch.is_tensor(samples[0]["labels"])
    labels = torch.full((n, width), -100, dtype=torch.long) if per_token else torch.tensor([s["labels"] for s in samples])
    for i, s in enumerate(samples):
        k = len(s["input_ids"])
        ids[i, :k], types[i, :k], mask[i, :k] = s["input_ids"], s["token_type_ids"], 1
        if per_token:
            labels[i, :k] = s["labels"]
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": labels}


def _pair(cls_name: str, attn: str = "sdpa", **kw):
    """(reference model, the same weights made padding-free)."""
    import transformers

    from megatron_patch.accelerations.padding_free import apply_padding_free

    torch.manual_seed(0)
    ref = getattr(transformers, cls_name)(_config(attn, **kw))
    packed = copy.deepcopy(ref)
    phrase = apply_padding_free(packed)
    assert phrase.startswith("padding-free:"), phrase
    return ref, packed


def _grads_close(ref, packed):
    for (name, p), q in zip(ref.named_parameters(), packed.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=TOL, atol=TOL, msg=name)


def _packed(samples, multiple: int = 16, max_segment: int = 64):
    from megatron_patch.data.flatten import FlattenCollator

    return FlattenCollator(_pad, multiple, max_segment)(samples)


# ---- the packed forward ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_sequence_classification_packed_equals_padded(attn):
    ref, packed = _pair("BertForSequenceClassification", attn)
    samples = _samples()
    padded, row = _pad(samples), _packed(samples)
    a, b = ref(**padded), packed(**row)
    torch.testing.assert_close(b.logits, a.logits, rtol=TOL, atol=TOL)
    torch.testing.assert_close(b.loss, a.loss, rtol=TOL, atol=TOL)
    a.loss.backward()
    b.loss.backward()
    _grads_close(ref, packed)
    # a padded batch through the padding-free model: the original attention and padding mask, as evaluation runs
    with torch.no_grad():
        torch.testing.assert_close(packed(**padded).logits, ref(**padded).logits, rtol=TOL, atol=TOL)


def test_token_classification_packed_equals_padded():
    ref, packed = _pair("BertForTokenClassification")
    samples = _samples(per_token=True)
    padded, row = _pad(samples, multiple=8), _packed(samples)
    a, b = ref(**padded), packed(**row)
    real = padded["attention_mask"].bool()
    total = int(real.sum())
    assert b.logits.shape == (1, row["input_ids"].shape[1], 3)
    torch.testing.assert_close(b.logits[0, :total], a.logits[real], rtol=TOL, atol=TOL)  # tokens in sample order
    torch.testing.assert_close(b.loss, a.loss, rtol=TOL, atol=TOL)
    a.loss.backward()
    b.loss.backward()
    _grads_close(ref, packed)


def test_packed_forward_applies_attention_dropout():
    """With attention dropout on (hidden dropout off), training-mode outputs differ from evaluation's; in eval
    mode the packed forward equals the padded one."""
    ref, packed = _pair("BertForSequenceClassification", attention_probs_dropout_prob=0.5)
    samples = _samples()
    row = _packed(samples)
    packed.train()
    torch.manual_seed(1)
    trained = packed(**row).logits
    packed.eval()
    ref.eval()
    with torch.no_grad():
        evaluated = packed(**row).logits
        torch.testing.assert_close(evaluated, ref(**_pad(samples)).logits, rtol=TOL, atol=TOL)
    assert (trained - evaluated).abs().max() > 1e-5  # 4e-4 seen; exactly 0 without the dropout


# ---- the collator ---------------------------------------------------------------------------------------------
def test_flatten_layout():
    from megatron_patch.data.flatten import PACKED_KEYS, flatten

    samples = [{"input_ids": torch.tensor([101, 7, 102]), "token_type_ids": torch.tensor([0, 0, 1]),
                "labels": torch.tensor([-100, 4, 5])},
               {"input_ids": torch.tensor([101, 102]), "token_type_ids": torch.tensor([0, 1]),
                "labels": torch.tensor([-100, 6])}]
    out = flatten(_pad(samples, multiple=4), multiple=4, max_segment=512, max_seq_len=512)
    assert list(out) == [k for k in PACKED_KEYS if k in out] and next(iter(out)) == "sample_starts"
    assert out["input_ids"].tolist() == [[101, 7, 102, 101, 102, 0, 0, 0]]
    assert out["token_type_ids"].tolist() == [[0, 0, 1, 0, 1, 0, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 0, 0]]
    assert out["cu_seq_lens"].tolist() == [0, 3, 5, 8] and out["cu_seq_lens"].dtype == torch.int32
    assert out["sample_starts"].tolist() == [0, 3]
    assert out["labels"].tolist() == [[-100, 4, 5, -100, 6, -100, -100, -100]]
    assert out["max_seq_len"] == 512
    # the tokens fill the budget exactly: an empty filler segment; per-sample labels stay as they were
    exact = flatten(_pad([{"input_ids": torch.tensor([1, 2, 3]), "token_type_ids": torch.zeros(3, dtype=torch.long),
                           "labels": 2},
                          {"input_ids": torch.tensor([4]), "token_type_ids": torch.zeros(1, dtype=torch.long),
                           "labels": 0}]), multiple=4, max_segment=16, max_seq_len=16)
    assert exact["cu_seq_lens"].tolist() == [0, 3, 4, 4] and exact["input_ids"].shape == (1, 4)
    assert exact["labels"].tolist() == [2, 0]


def test_flatten_refuses_what_it_cannot_pack():
    from megatron_patch.data.flatten import FlattenCollator, flatten

    batch = _pad(_samples((3, 5)))
    left = dict(batch, attention_mask=batch["attention_mask"].flip(1), input_ids=batch["input_ids"].flip(1))
    with pytest.raises(ValueError, match="not padded on the right"):
        flatten(left, 8, 64, 64)
    with pytest.raises(ValueError, match=r"idx cannot be packed.*drop --padding-free"):
        flatten(dict(batch, idx=torch.arange(2)), 8, 64, 64)
    with pytest.raises(ValueError, match="longer than the model's 4 positions"):
        flatten(batch, 8, 4, 8)
    with pytest.raises(ValueError, match="--pad-to-multiple-of 0"):
        FlattenCollator(_pad, 0, 64)


# ---- training: white box and black box --------------------------------------------------------------------------
def _args(argv):
    from megatron_patch.config.rapidformer_flags import parse_args
    from megatron_patch.templates.globals import set_args
    from megatron_patch.templates.rules import check

    args = check(parse_args(argv), world_size=1)
    set_args(args)
    return args


class _Log:
    def __init__(self):
        from megatron_patch.templates.globals import get_logger

        self.lines, self.logger = [], get_logger()
        self.handler = logging.Handler()
        self.handler.emit = lambda r: self.lines.append(r.getMessage())

    def __enter__(self):
        self.logger.addHandler(self.handler)
        return self.lines

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)


def _whitebox(extra):
    """A Finetuner script: 40 sentence pairs of 3-30 tokens, micro batch 4, 2 micro batches a step, 5 steps."""
    import transformers

    from megatron_patch.templates import Finetuner, RapidformerEngine

    args = _args(["--user-script", __file__, "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters",
                  "5", "--lr", "1e-3", "--seed", "3", "--log-interval", "5", *extra])
    g = torch.Generator().manual_seed(5)
    train = _samples([int(x) for x in torch.randint(3, 31, (40,), generator=g)], seed=1)
    valid = _samples((4, 9, 17, 2, 25, 6), seed=2)
    rec = {"losses": [], "shapes": set()}

    class Tune(Finetuner):
        def train_valid_test_datasets_provider(self):
            return train, valid, None, _pad

        def model_optimizer_lr_scheduler_provider(self):
            torch.manual_seed(0)
            return transformers.BertForSequenceClassification(_config()), None, None

        def run_forward_step(self, batch, model):
            rec["shapes"].add("packed" if "cu_seq_lens" in batch else "padded")
            loss = model(**batch).loss
            rec["losses"].append(loss.detach().clone())
            return loss

        def run_compute_metrics(self, model, eval_dataloader):
            logits, labels = [], []
            for batch in eval_dataloader:
                logits.append(model[0](**batch).logits)
                labels.append(batch["labels"])
            return {"loss": float(torch.nn.functional.cross_entropy(torch.cat(logits), torch.cat(labels)))}

    with _Log() as lines:
        rec["eval"] = Tune(RapidformerEngine(args)).train()["loss"]
    rec["losses"] = torch.stack(rec["losses"]).tolist()
    rec["lines"] = lines + args.notes
    return rec


@pytest.mark.parametrize("switches", [[], ["--lora-rank", "4", "--checkpoint-activations"]], ids=["plain", "lora_ckpt"])
def test_finetuner_trains_like_padded(switches):
    """With LoRA (peft's PeftModel calls the padding-free forward) and activation checkpointing too."""
    padded = _whitebox(switches)
    packed = _whitebox(["--padding-free", *switches])
    assert any(x.startswith("acceleration: padding-free: BertForSequenceClassification") for x in packed["lines"])
    assert any("one row of tokens padded to a multiple of 64" in x for x in packed["lines"]), packed["lines"][:5]
    assert padded["shapes"] == {"padded"} and packed["shapes"] == {"packed"}  # training batches arrive packed
    assert len(packed["losses"]) == len(padded["losses"]) == 10
    assert packed["losses"] == pytest.approx(padded["losses"], rel=TOL, abs=TOL)
    assert packed["eval"] == pytest.approx(padded["eval"], rel=TOL, abs=TOL)
    # the loop counts a step's samples by its batches' first entry: per sample in a packed row
    from megatron_patch.templates.torch_loop import EpochBatches

    counter = EpochBatches([], 1, 1)
    list(counter._counted(iter([_packed(_samples())]), 1))
    assert counter.samples == len(LENGTHS)


def _blackbox(tmp_path, extra, task="sequence_classification"):
    from megatron_patch.cli.tasks import task_class
    from megatron_patch.demo.task_files import write_task_dataset
    from megatron_patch.templates import RapidformerEngine

    data = tmp_path / "data"
    if not data.exists():
        write_task_dataset(task, str(data), n_train=48, n_valid=24)
        tiny_model("bert", str(tmp_path / "model"))
    args = _args(["--task", task, "--pretrained-model-name-or-path", str(tmp_path / "model"), "--data-path",
                  str(data), "--micro-batch-size", "8", "--train-iters", "6", "--seq-length", "64", "--lr", "2e-3",
                  "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "3", "--seed", "7",
                  "--save", str(tmp_path / f"out{len(extra)}"), *extra])
    losses = []

    class Recording(task_class(task)):
        def run_forward_step(self, batch, model):
            loss = super().run_forward_step(batch, model)
            losses.append(loss.detach().clone())
            return loss

    with _Log() as lines:
        metrics = Recording(RapidformerEngine(args)).train()
    return torch.stack(losses).tolist(), metrics, lines


def test_blackbox_sequence_classification_trains_like_padded(tmp_path):
    padded, padded_metrics, _ = _blackbox(tmp_path, [])
    packed, packed_metrics, lines = _blackbox(tmp_path, ["--padding-free"])
    assert any("acceleration: padding-free" in x for x in lines)
    assert len(packed) == len(padded) == 6
    assert packed == pytest.approx(padded, rel=TOL, abs=TOL)
    assert packed_metrics == pytest.approx(padded_metrics, rel=TOL, abs=TOL)


# ---- refusals ---------------------------------------------------------------------------------------------------
def test_refused_where_it_cannot_act(tmp_path, monkeypatch):
    import argparse

    import transformers

    from megatron_patch.accelerations import check_combination
    from megatron_patch.accelerations.padding_free import apply_padding_free
    from megatron_patch.cli.main import main
    from megatron_patch.config.rapidformer_flags import UsageError

    model, data = str(tmp_path / "m"), str(tmp_path)
    os.makedirs(model)
    common = ["--pretrained-model-name-or-path", model, "--data-path", data, "--padding-free"]
    with pytest.raises(UsageError, match=r"--padding-free with --task masked_lm: .*drop --padding-free"):
        _args(["--task", "masked_lm", *common])
    with pytest.raises(UsageError, match=r"--padding-free: fine-tuning a Hugging Face encoder on packed rows"):
        _args(["--task", "pretraining", *common, "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", "v",
               "--train-iters", "2"])
    with pytest.raises(ValueError, match="--onnx-runtime-training cannot run with --padding-free"):
        check_combination(argparse.Namespace(padding_free=True, onnx_runtime_training=True))
    # models: a family without the adapter's layout, a head without an adapter, regression
    with pytest.raises(ValueError, match=r"BERT-family encoders .* this model is 'gpt2': drop --padding-free"):
        apply_padding_free(transformers.GPT2ForSequenceClassification(transformers.GPT2Config(n_layer=1, n_embd=32,
                                                                                              n_head=2)))
    with pytest.raises(ValueError, match="the model is a BertForMaskedLM"):
        apply_padding_free(transformers.BertForMaskedLM(_config()))
    with pytest.raises(ValueError, match="single-label cross entropy .* regression"):
        apply_padding_free(transformers.BertForSequenceClassification(_config(num_labels=1)))
    # the black-box command with a causal LM directory: one line before any worker starts, exit 2
    from megatron_patch.demo.task_files import write_task_dataset

    write_task_dataset("sequence_classification", str(tmp_path / "pairs"), n_train=8, n_valid=4)
    gpt2 = tiny_model("gpt2", str(tmp_path / "gpt2"))
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    errors = []
    monkeypatch.setattr(sys, "stderr", type("E", (), {"write": lambda self, s: errors.append(s),
                                                       "flush": lambda self: None, "isatty": lambda self: False})())
    code = main(["--task", "sequence_classification", "--pretrained-model-name-or-path", gpt2, "--data-path",
                 str(tmp_path / "pairs"), "--padding-free"])
    assert code == 2, errors
    assert re.match(r"rapidformer: error: --padding-free runs BERT-family encoders .* this model is 'gpt2'",
                    "".join(errors)), errors


@pytest.mark.slow  # two launches of 2 gloo workers: about a minute
def test_two_workers_train_like_padded(tmp_path):
    """DDP on 2 gloo workers: the black-box run with --padding-free logs the padded run's losses (each step)."""
    from megatron_patch.demo.task_files import write_task_dataset

    data = write_task_dataset("sequence_classification", str(tmp_path / "data"), n_train=64, n_valid=16)
    model = tiny_model("bert", str(tmp_path / "model"))
    logged = {}
    for name, extra in (("padded", []), ("packed", ["--padding-free"])):
        proc = rapidformer("--task", "sequence_classification", "--pretrained-model-name-or-path", model,
                           "--data-path", data, "--micro-batch-size", "8", "--train-iters", "4", "--seq-length", "64",
                           "--lr", "2e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
                           "--nproc-per-node", "2", "--save", str(tmp_path / name), *extra)
        assert proc.returncode == 0, explain(proc)
        logged[name] = re.findall(r"\| loss ([0-9.]+) \|.*grad norm ([0-9.]+)", proc.stdout + proc.stderr)
    assert len(logged["padded"]) == 4 and logged["packed"] == logged["padded"], logged
