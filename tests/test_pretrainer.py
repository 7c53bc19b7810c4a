"""The PreTrainer template and black-box `--task pretraining`: the how-to's Megatron GPT sample against the
engine (TP2 x PP2, ZeRO-2, recompute: 4 CPU processes), its Hugging Face BERT sample (loss falls, exact resume),
black-box pretraining of BERT and GPT models, and the helpers the samples call."""
from __future__ import annotations

import json
import math
import os
import re
import shutil

import pytest
import torch

from conftest import ROOT, run_tool
from engine_utils import run_engine
from finetune_utils import explain, minilm_dir, rapidformer, tiny_model

GPT_SAMPLE = os.path.join(ROOT, "examples", "rapidformer_pretrain_megatron_gpt_trainer.py")
BERT_SAMPLE = os.path.join(ROOT, "examples", "rapidformer_pretrain_huggingface_bert_trainer.py")


def _jsonl(path, texts):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, texts, gpt2_files):
    """Real text made into both kinds of Megatron data by tools/preprocess_data.py: GPT-2 BPE documents and
    MiniLM WordPiece sentences (--split-sentences) and documents."""
    d = tmp_path_factory.mktemp("pretrain_data")
    _jsonl(d / "docs.jsonl", texts[:400])
    vocab, merges = gpt2_files
    run_tool("preprocess_data.py", "--input", str(d / "docs.jsonl"), "--output-prefix", str(d / "gpt"),
             "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod")
    wp = os.path.join(minilm_dir(), "vocab.txt")
    run_tool("preprocess_data.py", "--input", str(d / "docs.jsonl"), "--output-prefix", str(d / "bert"),
             "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", wp, "--split-sentences")
    run_tool("preprocess_data.py", "--input", str(d / "docs.jsonl"), "--output-prefix", str(d / "wpdoc"),
             "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", wp, "--append-eod")
    return {"gpt": str(d / "gpt_text_document"), "gpt_vocab": vocab, "gpt_merges": merges,
            "bert": str(d / "bert_text_sentence"), "wp_doc": str(d / "wpdoc_text_document"), "wp_vocab": wp}


def _lines(path):
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def _train(lines):
    return [x for x in lines if "loss" in x and x.get("split", "train") == "train" and "grad_norm" in x]


# ---- the Megatron GPT sample drives the engine ------------------------------------------------------------------
# name -> (processes, layout flags, the engine's data line); CI time: the 4-process TP2 x PP2 layout is slow
SAMPLE_LAYOUTS = {
    "tp2_zero2_recompute": (2, ["--tensor-model-parallel-size", "2"], "data: 1 of 2 ranks read batches",
                            "4 micro batches read"),
    "tp2_pp2_zero2_recompute": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
                                "data: 2 of 4 ranks read batches", "8 micro batches read"),
}


@pytest.mark.parametrize("layout", [pytest.param(n, marks=pytest.mark.slow if n == "tp2_pp2_zero2_recompute" else ())
                                    for n in SAMPLE_LAYOUTS])
def test_megatron_gpt_sample_equals_the_engine(corpora, tmp_path, layout):
    """The how-to's Megatron sample, as written (run_forward_step returns a loss), with TP2 (2 CPU processes; TP2 x
    PP2, 4 processes, in the slow lane), ZeRO-2 and activation checkpointing: per-iteration losses, grad norms and
    validation losses of pretrain_megatron_gpt.py on the same data, model and seed, within 1e-5 (fp32)."""
    nproc, parallel, readers, batches = SAMPLE_LAYOUTS[layout]
    flags = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--seq-length", "32", "--max-position-embeddings", "32",
             "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", corpora["gpt_vocab"], "--merge-file",
             corpora["gpt_merges"], "--data-path", corpora["gpt"], "--split", "980,20", "--lr", "1e-3",
             "--lr-decay-style", "linear", "--weight-decay", "1e-2", "--clip-grad", "1.0", "--lr-warmup-fraction",
             ".01", "--train-iters", "4", "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
             "--seed", "11", *parallel, "--zero-2-memory-optimization", "--checkpoint-activations"]
    engine, engine_proc = run_engine(tmp_path / "engine", nproc, *flags, base=[], torchrun=False)
    # the engine reads on tensor-parallel rank 0 of the first and last stages, 4 micro batches each
    assert readers in engine_proc.stdout and batches in engine_proc.stdout, engine_proc.stdout[-2000:]
    metrics = str(tmp_path / "rf.jsonl")
    proc = rapidformer("--user-script", GPT_SAMPLE, *flags, "--nproc-per-node", str(nproc), "--metrics-file", metrics)
    assert proc.returncode == 0, explain(proc)
    assert "megatron-core model: training with the engine" in proc.stdout
    assert "ZeRO-2" in proc.stdout and "recompute full" in proc.stdout  # the switches reached the model GPTModel() built
    ours = _lines(metrics)
    e_train, o_train = _train(engine), _train(ours)
    assert len(e_train) == len(o_train) == 4
    for e, o in zip(e_train, o_train):
        assert abs(e["loss"] - o["loss"]) < 1e-5 and abs(e["grad_norm"] - o["grad_norm"]) < 1e-5, (e, o)
    e_val = [x["valid_loss"] for x in engine if "valid_loss" in x]
    o_val = [x["valid_loss"] for x in ours if "valid_loss" in x]
    assert len(e_val) == len(o_val) == 2 and all(abs(a - b) < 1e-5 for a, b in zip(e_val, o_val))
    assert o_train[-1]["loss"] < o_train[0]["loss"]


# ---- the Hugging Face BERT sample ----------------------------------------------------------------------------------
def _bert_flags(model, corpora, iters, *extra):
    return ["--user-script", BERT_SAMPLE, "--pretrained-model-name-or-path", model, "--micro-batch-size", "8",
            "--global-batch-size", "16", "--seq-length", "64", "--tokenizer-type", "BertWordPieceLowerCase",
            "--max-position-embeddings", "256", "--train-iters", str(iters), "--data-path", corpora["bert"],
            "--vocab-file", corpora["wp_vocab"], "--data-impl", "mmap", "--split", "980,20", "--lr", "1e-3",
            "--lr-decay-style", "linear", "--weight-decay", "1e-2", "--clip-grad", "1.0", "--lr-warmup-fraction",
            ".01", "--log-interval", "1", "--eval-interval", "1000", "--seed", "5", *extra]


@pytest.mark.parametrize("sharding", [pytest.param(("--zero-1-memory-optimization", "--data-iterator", "dynamic-shape"),
                                                   marks=pytest.mark.slow),  # CI time
                                      pytest.param(("--zero-3-memory-optimization",), marks=pytest.mark.slow)])
def test_bert_sample_resumes_exactly(corpora, tmp_path, sharding):
    """The how-to's BERT PreTrainer sample on 2 workers (ZeRO-1: optimizer shards per rank, with
    --data-iterator dynamic-shape; ZeRO-3: FSDP2 through torch.distributed.checkpoint): 6 iterations with a
    checkpoint at 3; a second run resumed from that checkpoint gives iterations 4-6 exactly (dropout on: the RNG
    state and the data position are restored)."""
    model = tiny_model("bert", str(tmp_path / "bert"))
    full = str(tmp_path / "full")
    proc = rapidformer(*_bert_flags(model, corpora, 6, *sharding, "--nproc-per-node", "2", "--save", full,
                                    "--save-interval", "3"))
    assert proc.returncode == 0, explain(proc)
    assert ("dynamic-shape: padding" in proc.stdout) == ("dynamic-shape" in sharding)
    whole = _train(_lines(os.path.join(full, "metrics.jsonl")))
    resume = str(tmp_path / "resume")
    shutil.copytree(full, resume)
    with open(os.path.join(resume, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    os.remove(os.path.join(resume, "metrics.jsonl"))
    proc = rapidformer(*_bert_flags(model, corpora, 6, *sharding, "--nproc-per-node", "2", "--load", resume,
                                    "--save", resume, "--save-interval", "3"))
    assert proc.returncode == 0, explain(proc)
    assert "resumed from" in proc.stdout
    resumed = _train(_lines(os.path.join(resume, "metrics.jsonl")))
    assert [x["iteration"] for x in resumed] == [4, 5, 6]
    for a, b in zip(whole[3:], resumed):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                  abs=1e-6), (a, b)


# ---- black-box --task pretraining ----------------------------------------------------------------------------------
@pytest.mark.slow  # CI time: black-box pretraining is test_blackbox_causal_pretraining_...; BERT's MLM + NSP the PreTrainer's
def test_blackbox_bert_pretraining_howto_command_loss_falls(corpora, tmp_path):
    """The how-to's black-box command (--fsdp-memory-optimization; ORT and fp16 left out on a CPU) with the
    real MiniLM directory and tiny shape flags: new weights (said in the log), MLM + NSP loss falls, the model
    is saved with save_pretrained and loads in transformers."""
    save = str(tmp_path / "out")
    proc = rapidformer("--task", "pretraining", "--pretrained-model-name-or-path", minilm_dir(), "--num-layers", "2",
                       "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "8",
                       "--global-batch-size", "16", "--seq-length", "64", "--tokenizer-type", "BertWordPieceLowerCase",
                       "--max-position-embeddings", "64", "--train-iters", "24", "--data-path", corpora["bert"],
                       "--vocab-file", corpora["wp_vocab"], "--data-impl", "mmap", "--split", "980,20", "--lr", "1e-3",
                       "--lr-decay-style", "linear", "--min-lr", "0.0", "--lr-decay-iters", "2000", "--weight-decay",
                       "1e-2", "--clip-grad", "1.0", "--lr-warmup-fraction", ".01", "--fsdp-memory-optimization",
                       "--nproc-per-node", "2", "--log-interval", "1", "--eval-interval", "12", "--eval-iters", "4",
                       "--save", save)
    assert proc.returncode == 0, explain(proc)
    assert "model: new weights (the shape flags differ" in proc.stdout and "num_hidden_layers 6 -> 2" in proc.stdout
    lines = _lines(os.path.join(save, "metrics.jsonl"))
    losses = [x["loss"] for x in _train(lines)]
    assert len(losses) == 24 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, losses
    val = [x["loss"] for x in lines if x.get("split") == "validation"]
    assert len(val) == 2 and val[1] < val[0]
    from transformers import BertForPreTraining

    model = BertForPreTraining.from_pretrained(save)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64


def test_blackbox_causal_pretraining_starts_from_the_directory_weights(corpora, tmp_path):
    """A GPT-2 directory whose shape the flags match: training starts from its weights (the first loss equals
    the directory model's loss on the first batch), the causal loss falls."""
    model_dir = tiny_model("gpt2", str(tmp_path / "gpt2"))
    save = str(tmp_path / "out")
    proc = rapidformer("--task", "pretraining", "--pretrained-model-name-or-path", model_dir, "--num-layers", "2",
                       "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "4",
                       "--global-batch-size", "4", "--seq-length", "32", "--tokenizer-type", "BertWordPieceLowerCase",
                       "--vocab-file", corpora["wp_vocab"], "--data-path", corpora["wp_doc"], "--split", "98,2",
                       "--train-iters", "20", "--lr", "3e-3", "--log-interval", "1", "--eval-interval", "1000",
                       "--seed", "3", "--save", save)
    assert proc.returncode == 0, explain(proc)
    assert "model: starting from the weights in" in proc.stdout
    # the two log lines about samples agree (80 drawn) and say what the dataset's larger count is
    assert "samples to draw: train 80 (20 iterations of 4)" in proc.stdout
    assert re.search(r"training: 20 iterations of 4 samples .*: 80 of the training dataset's \d+ samples", proc.stdout)
    losses = [x["loss"] for x in _train(_lines(os.path.join(save, "metrics.jsonl")))]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses
    # the first loss is the directory model's on the first 4 samples
    from transformers import GPT2LMHeadModel

    from megatron_patch.config.rapidformer_flags import parse_args
    from megatron_patch.templates.globals import set_args
    from megatron_patch.templates.gpt_samples import build_train_valid_test_datasets

    set_args(parse_args(["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", corpora["wp_vocab"]]))
    train, _, _ = build_train_valid_test_datasets(corpora["wp_doc"], "mmap", "98,2", [80, 4, 4], 32, 3)
    text = torch.stack([torch.as_tensor(train[i]["text"]) for i in range(4)])
    ref = GPT2LMHeadModel.from_pretrained(model_dir).train(False)
    with torch.no_grad():
        logits = ref(input_ids=text[:, :-1]).logits
    first = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), text[:, 1:].reshape(-1)).item()
    # dropout is on in training (GPT-2's 0.1), so compare loosely: the same model, not a new one (~ln 30522 = 10.3)
    assert abs(losses[0] - first) < 0.15, (losses[0], first)


# ---- refusals in words -------------------------------------------------------------------------------------------
def test_tensor_parallelism_with_a_hugging_face_model_is_refused(corpora, tmp_path):
    model = tiny_model("bert", str(tmp_path / "bert"))
    proc = rapidformer(*_bert_flags(model, corpora, 2, "--tensor-model-parallel-size", "2", "--nproc-per-node", "2"))
    assert proc.returncode != 0
    assert "tensor and pipeline parallelism are for Megatron models" in proc.stdout + proc.stderr
    # a PreTrainer script given --epochs (a fine-tuning run's length) instead of --train-iters: refused once
    # PreTrainer.train() says the script pretrains (the command line alone cannot tell), in one line with exit 2 (a
    # ConfigError raised in PreTrainer.train() of one worker, the worker in the launching process)
    proc = rapidformer(*_without(_bert_flags(model, corpora, 2), "--train-iters"), "--epochs", "1")
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.startswith("rapidformer: error: pretraining is iteration-based: give --train-iters N"), \
        explain(proc)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stdout + proc.stderr, explain(proc)


def test_front_end_rules_for_pretraining():
    from megatron_patch.config.rapidformer_flags import UsageError, parse_args
    from megatron_patch.templates.rules import check

    with pytest.raises(UsageError, match="--task pretraining needs --data-path, --tokenizer-type, --vocab-file"):
        check(parse_args(["--task", "pretraining", "--pretrained-model-name-or-path", "m", "--train-iters", "5"]), 1)
    # the how-to's Megatron command: a user script with TP2 x PP2 on 4 workers is accepted; DP = 1, so 128
    # samples of 16 are 8 micro batches
    a = check(parse_args(["--user-script", GPT_SAMPLE, "--tensor-model-parallel-size", "2",
                          "--pipeline-model-parallel-size", "2", "--micro-batch-size", "16", "--global-batch-size",
                          "128", "--train-iters", "100"]), 4)
    assert a.grad_accumulation == 8 and a.epochs is None
    a = check(parse_args(["--task", "pretraining", "--pretrained-model-name-or-path", "m", "--data-path", "d",
                          "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", "v", "--train-iters", "5"]), 1)
    assert a.save and any("--save not given" in n for n in a.notes)


# ---- what the samples call -----------------------------------------------------------------------------------------
def _ltor_reference(data, eod, reset_pos, reset_att, eod_mask):
    """Position by position: document of each token, then the masks and positions."""
    b, s = data.shape
    att = torch.zeros(b, 1, s, s, dtype=torch.bool)
    pos = torch.zeros(b, s, dtype=torch.long)
    loss = torch.ones(b, s)
    for i in range(b):
        doc, start = [], 0
        for t in range(s):
            doc.append(start)
            if data[i, t] == eod:
                start = t + 1
        for q in range(s):
            pos[i, q] = q - doc[q] if reset_pos else q
            for k in range(s):
                att[i, 0, q, k] = k > q or (reset_att and doc[k] != doc[q])
            if eod_mask and data[i, q] == eod:
                loss[i, q] = 0
    return att, loss, pos


@pytest.mark.parametrize("reset_pos,reset_att,eod_mask", [(False, False, False), (True, True, True),
                                                           (True, False, False)])
def test_ltor_masks_and_position_ids_match_a_per_token_reference(reset_pos, reset_att, eod_mask):
    from megatron_patch.templates.gpt_samples import get_ltor_masks_and_position_ids

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 6, (3, 17), generator=g)  # eod = 0: several documents per row
    att, loss, pos = get_ltor_masks_and_position_ids(data, 0, reset_pos, reset_att, eod_mask)
    r_att, r_loss, r_pos = _ltor_reference(data, 0, reset_pos, reset_att, eod_mask)
    assert torch.equal(att.expand_as(r_att), r_att) and torch.equal(loss, r_loss) and torch.equal(pos, r_pos)


def test_broadcast_data_without_tensor_parallelism_moves_and_casts():
    from megatron_patch.templates import mpu

    out = mpu.broadcast_data(["a", "b"], {"a": torch.arange(6).view(2, 3).int(), "b": [1, 0]}, torch.int64)
    assert out["a"].dtype == torch.int64 and out["a"].shape == (2, 3) and out["b"].tolist() == [1, 0]
    with pytest.raises(KeyError, match=r"no \['c'\]"):
        mpu.broadcast_data(["c"], {"a": torch.zeros(1)}, torch.int64)
    with pytest.raises(ValueError, match="data iterator ran out"):
        mpu.broadcast_data(["a"], None, torch.int64)
    assert callable(mpu.get_tensor_model_parallel_rank)  # megatron-core's parallel state is there too


def test_the_documented_imports_work():
    import rapidformer
    from rapidformer import (Pretrainer, PreTrainer, build_train_valid_test_datasets,  # noqa: F401
                             build_train_valid_test_datasets_for_huggingface, get_ltor_masks_and_position_ids,
                             get_tokenizer, mpu)
    from megatron_patch.models import GPTModel

    assert Pretrainer is PreTrainer and callable(GPTModel) and hasattr(rapidformer.mpu, "broadcast_data")
    with pytest.raises(RuntimeError, match="model_optimizer_lr_scheduler_provider"):
        GPTModel()


# ---- --data-iterator dynamic-shape ---------------------------------------------------------------------------------
def test_dynamic_shape_keeps_each_steps_samples_and_their_losses_with_less_padding(corpora):
    """The micro batches of one step hold the same samples as fixed-shape, bucketed by length under the token
    budget and cut to their longest sample; every sample's masked-LM + NSP loss (a tiny BertForPreTraining, eval
    mode) is the one it has when padded to --seq-length; fewer tokens are computed."""
    from transformers import BertConfig, BertForPreTraining

    from megatron_patch.config.rapidformer_flags import parse_args
    from megatron_patch.templates.globals import set_args
    from megatron_patch.data.dynamic_shape import StepBuckets
    from megatron_patch.templates.pretraining_data import build_train_valid_test_datasets_for_huggingface

    set_args(parse_args(["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", corpora["wp_vocab"]]))
    train, _, _ = build_train_valid_test_datasets_for_huggingface(corpora["bert"], "mmap", "980,20", [48, 8, 0], 128,
                                                                  0.15, 0.1, 5, True, True)
    loader = torch.utils.data.DataLoader(train, batch_size=4)
    fixed = [b for _, b in zip(range(12), loader)]
    dyn = StepBuckets(iter(fixed), accum=3, micro_batch_size=4, seq_length=128, multiple=8)
    steps = []
    for _ in range(4):  # 4 steps of 3 fixed micro batches each
        n = dyn.next_step()
        steps.append([next(dyn) for _ in range(n)])
        assert abs(sum(dyn.weights) - 1) < 1e-9 and dyn.weights == [len(b["input_ids"]) / 12 for b in steps[-1]]
        for b in steps[-1]:  # within the token budget of 4 x 128 after padding (a micro batch may hold more samples)
            assert b["input_ids"].numel() <= 4 * 128 or len(b["input_ids"]) == 1
    regrouped = [b for step in steps for b in step]
    assert dyn.computed < 0.9 * dyn.fixed and dyn.real == sum(int(b["attention_mask"].sum()) for b in fixed)
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, intermediate_size=64, max_position_embeddings=128))
    model.train(False)

    def per_sample(batches):
        out = {}
        with torch.no_grad():
            for b in batches:
                o = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                          token_type_ids=b["token_type_ids"])
                mlm = torch.nn.functional.cross_entropy(o.prediction_logits.transpose(1, 2), b["labels"],
                                                        ignore_index=-100, reduction="none").sum(1)
                nsp = torch.nn.functional.cross_entropy(o.seq_relationship_logits, b["next_sentence_label"],
                                                        reduction="none")
                for row in range(len(mlm)):
                    real = b["input_ids"][row][b["attention_mask"][row].bool()]
                    out.setdefault(tuple(real.tolist()), []).append((mlm[row].item(), nsp[row].item()))
        return out

    a, b = per_sample(fixed), per_sample(regrouped)
    assert a.keys() == b.keys() and sum(len(v) for v in b.values()) == 48
    for key in a:
        for (m1, n1), (m2, n2) in zip(sorted(a[key]), sorted(b[key])):
            assert abs(m1 - m2) < 1e-4 and abs(n1 - n2) < 1e-5
    # each step's samples are the same: step k of both holds the same sample keys
    for k in range(4):
        keys = [{tuple(r[m.bool()].tolist()) for bb in batches for r, m in zip(bb["input_ids"], bb["attention_mask"])}
                for batches in (fixed[3 * k:3 * k + 3], steps[k])]
        assert keys[0] == keys[1]


@pytest.mark.slow
def test_megatron_gpt_sample_resumes_exactly(corpora, tmp_path):
    """The Megatron sample through the engine's checkpoints: 6 iterations saved at 3; resumed from iteration 3 it
    gives iterations 4-6 exactly (dropout 0.1 on)."""
    flags = ["--user-script", GPT_SAMPLE, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "32", "--tokenizer-type",
             "GPT2BPETokenizer", "--vocab-file", corpora["gpt_vocab"], "--merge-file", corpora["gpt_merges"],
             "--data-path", corpora["gpt"], "--split", "980,20", "--lr", "1e-3", "--train-iters", "6",
             "--log-interval", "1", "--eval-interval", "100", "--seed", "7"]
    save = str(tmp_path / "ck")
    proc = rapidformer(*flags, "--save", save, "--save-interval", "3", "--metrics-file", str(tmp_path / "a.jsonl"))
    assert proc.returncode == 0, explain(proc)
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    proc = rapidformer(*flags, "--load", save, "--metrics-file", str(tmp_path / "b.jsonl"))
    assert proc.returncode == 0, explain(proc)
    whole, resumed = _train(_lines(tmp_path / "a.jsonl")), _train(_lines(tmp_path / "b.jsonl"))
    assert [x["iteration"] for x in resumed] == [4, 5, 6]
    for a, b in zip(whole[3:], resumed):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)


NSP_SCRIPT = '''
import torch
from rapidformer import PreTrainer, RapidformerEngine, build_train_valid_test_datasets_for_huggingface, get_args, mpu
from transformers import BertForPreTraining


class NSPOnly(PreTrainer):
    """A loss that is a mean over samples (next-sentence prediction only), so a step's loss does not depend on
    how the step's samples are grouped into micro batches."""

    def train_valid_test_datasets_provider(self, n):
        a = get_args()
        return build_train_valid_test_datasets_for_huggingface(a.data_path, a.data_impl, a.split, n, a.seq_length,
                                                              a.mask_prob, a.short_seq_prob, a.seed, True, True)

    def model_optimizer_lr_scheduler_provider(self):
        return BertForPreTraining.from_pretrained(get_args().pretrained_model_name_or_path), None, None

    def run_forward_step(self, data_iterator, model):
        keys = ["input_ids", "attention_mask", "token_type_ids", "next_sentence_label"]
        b = mpu.broadcast_data(keys, next(data_iterator) if data_iterator is not None else None, torch.int64)
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], token_type_ids=b["token_type_ids"])
        return torch.nn.functional.cross_entropy(out.seq_relationship_logits.float(), b["next_sentence_label"])


if __name__ == "__main__":
    NSPOnly(RapidformerEngine()).train()
'''


def test_dynamic_shape_weighs_micro_batches_by_their_samples(corpora, tmp_path):
    """With a per-sample-mean loss and dropout off, dynamic-shape's steps (micro batches of unequal sizes, each
    weighted by its share of the step's samples) give fixed-shape's losses and gradient norms."""
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    model_dir = str(tmp_path / "bert")
    BertForPreTraining(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)).save_pretrained(model_dir)
    script = tmp_path / "nsp.py"
    script.write_text(NSP_SCRIPT)
    runs = {}
    for it in ("fixed-shape", "dynamic-shape"):
        metrics = str(tmp_path / f"{it}.jsonl")
        proc = rapidformer("--user-script", str(script), "--pretrained-model-name-or-path", model_dir,
                           "--micro-batch-size", "4", "--global-batch-size", "12", "--seq-length", "128",
                           "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", corpora["wp_vocab"],
                           "--data-path", corpora["bert"], "--split", "980,20", "--train-iters", "3", "--lr", "1e-3",
                           "--log-interval", "1", "--eval-interval", "100", "--seed", "5", "--data-iterator", it,
                           "--metrics-file", metrics)
        assert proc.returncode == 0, explain(proc)
        runs[it] = _train(_lines(metrics))
    assert "computed_tokens" in runs["dynamic-shape"][-1]
    for f, d in zip(runs["fixed-shape"], runs["dynamic-shape"]):
        assert abs(f["loss"] - d["loss"]) < 1e-5 and abs(f["grad_norm"] - d["grad_norm"]) < 1e-4, (f, d)


# ---- the Hugging Face PreTrainer's checkpoints ---------------------------------------------------------------------
def _ckpt_flags(model, corpora, *extra):
    """10 iterations of 8 samples, evaluation every 2 on 2 batches (so each evaluation reads new validation
    samples), a checkpoint every 5."""
    return ["--user-script", BERT_SAMPLE, "--pretrained-model-name-or-path", model, "--micro-batch-size", "4",
            "--global-batch-size", "8", "--seq-length", "64", "--tokenizer-type", "BertWordPieceLowerCase",
            "--train-iters", "10", "--data-path", corpora["bert"], "--vocab-file",
            corpora["wp_vocab"], "--split", "980,20", "--lr", "1e-3", "--lr-decay-style", "linear", "--weight-decay",
            "1e-2", "--clip-grad", "1.0", "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-interval", "2",
            "--eval-iters", "2", "--save-interval", "5", "--seed", "5", *extra]


def _validation(lines):
    return [(x["iteration"], x["loss"]) for x in lines if x.get("split") == "validation"]


def _same(a, b, tol):
    """The same iterations, losses and gradient norms within `tol`, and the same learning rates."""
    assert [x["iteration"] for x in a] == [x["iteration"] for x in b], (a, b)
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= tol and abs(x["grad_norm"] - y["grad_norm"]) <= tol, (x, y)
        assert x["lr"] == pytest.approx(y["lr"], rel=1e-12, abs=0), (x, y)


@pytest.fixture(scope="module")
def hf_run(corpora, tmp_path_factory):
    """The BERT sample (dropout 0.1 on) on one worker, 10 iterations, checkpoints at 5 and 10."""
    d = tmp_path_factory.mktemp("hf_ckpt")
    model = tiny_model("bert", str(d / "bert"))
    save = str(d / "full")
    proc = rapidformer(*_ckpt_flags(model, corpora, "--save", save))
    assert proc.returncode == 0, explain(proc)
    return {"model": model, "save": save, "lines": _lines(os.path.join(save, "metrics.jsonl"))}


def test_hf_pretrainer_falls_back_from_a_damaged_checkpoint_and_resumes_exactly(corpora, hf_run, tmp_path):
    """(~20 s: one 1-worker run beside the fixture's.) One shard of the newest checkpoint (iteration 10) is
    deleted: --load falls back to iteration 5 with a warning naming both, and iterations 6-10 give the
    uninterrupted run's losses, gradient norms and validation losses (evaluation every 2 iterations: the
    validation position is restored) within 1e-6, dropout on (the random streams are restored)."""
    from megatron_patch.config.checkpoint_layout import read_manifest

    full = hf_run["save"]
    manifest = read_manifest(os.path.join(full, "iter_0000010"))
    # the manifest, written last, lists every file with its size; validation read 5 evaluations x 2 x 8
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "rank_00000.pt", "train_state.pt"} <= set(manifest["files"])
    assert manifest["consumed_samples"] == 80 and manifest["consumed_valid_samples"] == 80
    assert os.path.isfile(os.path.join(full, "latest_checkpointed_iteration.txt"))
    assert not [n for n in os.listdir(full) if n.endswith((".tmp", ".old"))]
    resume = str(tmp_path / "resume")
    shutil.copytree(full, resume)
    os.remove(os.path.join(resume, "metrics.jsonl"))
    os.remove(os.path.join(resume, "iter_0000010", "dcp", "__0_0.distcp"))
    proc = rapidformer(*_ckpt_flags(hf_run["model"], corpora, "--load", resume, "--save", resume))
    assert proc.returncode == 0, explain(proc)
    assert (f"WARNING: {resume}/iter_0000010 is incomplete (dcp/__0_0.distcp is missing); loading the newest "
            f"complete checkpoint before it instead: {resume}/iter_0000005") in proc.stdout, explain(proc)
    assert "resumed from" in proc.stdout and "at iteration 5 (40 training and 32 validation samples" in proc.stdout
    resumed = _lines(os.path.join(resume, "metrics.jsonl"))
    _same(_train(hf_run["lines"])[5:], _train(resumed), 1e-6)
    whole_val, resumed_val = _validation(hf_run["lines"]), _validation(resumed)
    assert [i for i, _ in resumed_val] == [6, 8, 10]
    for (i, a), (j, b) in zip(whole_val[2:], resumed_val):
        assert i == j and abs(a - b) <= 1e-6, (whole_val, resumed_val)
    assert len({round(v, 6) for _, v in whole_val}) == len(whole_val)  # each evaluation read other samples


def test_hf_checkpoint_selection_and_refusals_in_words(hf_run, tmp_path):
    """(< 5 s, in process.) A truncated file falls back too; with no complete checkpoint left, or the old
    tracker name of an earlier layout, one line says what to do; a checkpoint file holding a pickled object that
    weights_only refuses is refused naming the file (the manifest rewritten to match, as a tamperer would)."""
    import argparse

    from transformers import BertForPreTraining

    from megatron_patch.accelerations.precision import Precision
    from megatron_patch.training.checkpoint.torch_dcp import find_checkpoint, load_checkpoint
    from megatron_patch.templates.schedule import build_scheduler
    from megatron_patch.config.checkpoint_layout import CheckpointError, read_manifest, write_manifest

    root = str(tmp_path / "ck")
    shutil.copytree(hf_run["save"], root)
    assert find_checkpoint(root) == (10, [])
    with open(os.path.join(root, "iter_0000010", "train_state.pt"), "r+b") as f:
        f.truncate(100)
    iteration, warnings = find_checkpoint(root)
    assert iteration == 5 and "train_state.pt has 100 bytes" in warnings[0]
    os.remove(os.path.join(root, "iter_0000005", "rank_00000.pt"))
    with pytest.raises(CheckpointError, match="holds no earlier complete checkpoint"):
        find_checkpoint(root)
    legacy = str(tmp_path / "legacy")
    os.makedirs(legacy)
    with open(os.path.join(legacy, "latest_iteration.txt"), "w") as f:
        f.write("3")
    with pytest.raises(CheckpointError, match="latest_iteration.txt.*weights_only=True refuses"):
        find_checkpoint(legacy)

    class Planted:  # unpickling it calls os.getcwd: any function could be called there
        def __reduce__(self):
            return os.getcwd, ()

    # a tampered rank file, the manifest's sizes rewritten
    root = str(tmp_path / "tampered")
    shutil.copytree(hf_run["save"], root)
    path = os.path.join(root, "iter_0000010")
    torch.save({"python": Planted()}, os.path.join(path, "rank_00000.pt"))
    manifest = read_manifest(path)
    manifest.pop("files")
    os.remove(os.path.join(path, "checkpoint.json"))
    write_manifest(path, manifest)
    assert find_checkpoint(root) == (10, [])
    model = BertForPreTraining.from_pretrained(hf_run["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args = argparse.Namespace(lr_warmup_iters=2, lr_warmup_fraction=None, lr_decay_iters=None, lr=1e-3, min_lr=0.0,
                              lr_decay_style="linear")
    with pytest.raises(CheckpointError, match=r"rank_00000.pt: refused to unpickle posix.getcwd\. Loading a "
                                              "checkpoint never runs code"):
        load_checkpoint(root, 10, model, optimizer, build_scheduler(args, optimizer, 10), Precision(None, "cpu"))
    # the schedule and the fp16 loss scaler load under weights_only=True
    state = torch.load(os.path.join(path, "train_state.pt"), weights_only=True)
    assert state["scheduler"]["last_epoch"] == 10
    scaler = Precision(torch.float16, "cpu")
    torch.save(scaler.state_dict(), str(tmp_path / "scaler.pt"))
    assert torch.load(str(tmp_path / "scaler.pt"), weights_only=True) == scaler.state_dict()


# ---- the Hugging Face PreTrainer's resume semantics (Megatron-LM's rule: templates/resume_hf.py) -------------------
# hf_run's schedule: --lr 1e-3 to --min-lr 0, linear, --lr-warmup-iters 2, decay over its --train-iters 10 (global
# batch 8), --weight-decay 0.01; checkpoints at 5 and 10.

def _without(flags, name):
    """`flags` without the option `name` and its value."""
    i = flags.index(name)
    return flags[:i] + flags[i + 2:]


def _hf_config(model, corpora, *argv, drop=()):
    """The engine Config PreTrainer.train() hands the Hugging Face loop, for `_ckpt_flags` changed by `argv`."""
    from megatron_patch.config.rapidformer_flags import parse_args
    from megatron_patch.templates.rules import check
    from megatron_patch.templates.pretrain_megatron import engine_config

    flags = _ckpt_flags(model, corpora)
    for name in drop:
        flags = _without(flags, name)
    return engine_config(check(parse_args([*flags, *argv]), 1), accelerations=False)


HF_SCHEDULE_CHANGES = {  # flags -> what the refusal says (the checkpoint's value, this run's, the flag)
    "train_iters": (["--train-iters", "12"],
                    "lr decay over 10 iterations in the checkpoint, 12 here: --train-iters 12 (--lr-decay-iters "
                    "defaults to it)"),
    "lr": (["--lr", "2e-3"], "--lr 0.001 in the checkpoint, 0.002 here"),
    "min_lr": (["--min-lr", "1e-5"], "--min-lr 0 in the checkpoint, 1e-05 here"),
    "decay_iters": (["--lr-decay-iters", "20"], "lr decay over 10 iterations in the checkpoint, 20 here: "
                                                "--lr-decay-iters 20"),
    "decay_style": (["--lr-decay-style", "cosine"], "--lr-decay-style linear in the checkpoint, cosine here"),
    "warmup_iters": (["--lr-warmup-iters", "3"], "warmup 2 iterations in the checkpoint, 3 here: --lr-warmup-iters 3"),
    # the Hugging Face PreTrainer takes the fraction of --train-iters (templates/schedule.py)
    "warmup_fraction": (["--lr-warmup-fraction", "0.5"],
                        "warmup 2 iterations in the checkpoint, 5 here: --lr-warmup-fraction 0.5 of --train-iters"),
    "weight_decay": (["--weight-decay", "0.1"], "--weight-decay 0.01 in the checkpoint, 0.1 here"),
    "past_decay": (["--train-iters", "12", "--lr-decay-iters", "10"],
                   "--train-iters 12 runs past the end of the checkpoint's lr decay (iteration 10, where its run of "
                   "--train-iters 10 ended): iterations 11-12 would train at --min-lr 0"),
}


@pytest.mark.parametrize("change", list(HF_SCHEDULE_CHANGES))
def test_hf_resume_refuses_a_changed_schedule(corpora, hf_run, change):
    """(In process, milliseconds.) Each schedule flag that differs from the checkpoint's settings is refused in one
    line naming both values and the flag, with the engine's wording; either scheduler flag accepts it and says which
    schedule is continued."""
    from megatron_patch.config import ConfigError
    from megatron_patch.templates.resume_hf import plan

    flags, says = HF_SCHEDULE_CHANGES[change]
    drop = ("--lr-warmup-iters",) if change == "warmup_fraction" else ()
    ck = hf_run["save"]
    longer = " and --lr-decay-iters 12" if change == "past_decay" else ""
    with pytest.raises(ConfigError) as e:
        plan(_hf_config(hf_run["model"], corpora, *flags, drop=drop), ck, 5, own_scheduler=False)
    assert str(e.value) == (
        f"--load {ck} (iteration 5) continues a learning-rate schedule that this run's flags change: {says}. Pass "
        f"--override-opt-param-scheduler{longer} to continue from iteration 5 with this run's schedule, or "
        f"--use-checkpoint-opt-param-scheduler to keep the checkpoint's")
    override = plan(_hf_config(hf_run["model"], corpora, *flags, "--override-opt-param-scheduler", drop=drop), ck, 5,
                    own_scheduler=False)
    keep = plan(_hf_config(hf_run["model"], corpora, *flags, "--use-checkpoint-opt-param-scheduler", drop=drop), ck, 5,
                own_scheduler=False)
    assert not override.from_checkpoint and keep.from_checkpoint
    # the checkpoint's schedule, rebuilt from its stored settings: hf_run's flags
    assert keep.schedule == plan(_hf_config(hf_run["model"], corpora), None, None, own_scheduler=False).schedule
    if change != "past_decay":  # (there the schedule is the same; the run goes on past its end)
        assert override.settings != keep.settings  # the weight decay is in the settings, not in the lr's Schedule


def test_hf_resume_schedule_rules(corpora, hf_run, tmp_path):
    """(In process, < 1 s.) The same schedule is no change: another --global-batch-size with the same iterations
    (the HF loop's LambdaLR counts optimizer steps, not samples) and a --train-iters inside a decay that goes on.
    The scheduler flags are refused where they cannot act, an engine checkpoint is left to the loader's refusal,
    and --task pretraining refuses a changed schedule before launch (the front end's validate())."""
    from megatron_patch.config.rapidformer_flags import UsageError, parse_args
    from megatron_patch.templates.rules import check
    from megatron_patch.config import ConfigError
    from megatron_patch.templates.resume_hf import plan

    ck, model = hf_run["save"], hf_run["model"]
    for argv in ([], ["--global-batch-size", "16"], ["--train-iters", "8", "--lr-decay-iters", "10"]):
        assert not plan(_hf_config(model, corpora, *argv), ck, 5, own_scheduler=False).from_checkpoint
    with pytest.raises(ConfigError, match="^--override-opt-param-scheduler takes this run's schedule, "
                                          "--use-checkpoint-opt-param-scheduler the checkpoint's: pass only one$"):
        plan(_hf_config(model, corpora, "--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"),
             ck, 5, own_scheduler=False)
    with pytest.raises(ConfigError, match="^--use-checkpoint-opt-param-scheduler: it applies when resuming a "
                                          "checkpoint with --load; drop the flag$"):
        plan(_hf_config(model, corpora, "--use-checkpoint-opt-param-scheduler"), None, None, own_scheduler=False)
    with pytest.raises(ConfigError, match="^--override-opt-param-scheduler: the scheduler of "
                                          r"model_optimizer_lr_scheduler_provider\(\) restores its own state; drop"):
        plan(_hf_config(model, corpora, "--override-opt-param-scheduler"), ck, 5, own_scheduler=True)
    assert plan(_hf_config(model, corpora, "--lr", "2e-3"), ck, 5, own_scheduler=True).schedule is None
    # an engine checkpoint is not compared as one of ours: loading it refuses it, naming what it is
    engine = tmp_path / "engine" / "iter_0000005"
    engine.mkdir(parents=True)
    manifest = json.loads(open(os.path.join(ck, "iter_0000005", "checkpoint.json")).read())
    (engine / "checkpoint.json").write_text(json.dumps(dict(manifest, format="torch_dist", layout={})))
    assert not plan(_hf_config(model, corpora, "--lr", "2e-3"), str(tmp_path / "engine"), 5,
                    own_scheduler=False).from_checkpoint
    # a checkpoint of a run on its own scheduler stores no settings: nothing to compare, nothing to keep
    own = tmp_path / "own" / "iter_0000005"
    own.mkdir(parents=True)
    (own / "checkpoint.json").write_text(json.dumps(dict(manifest, scheduler=None)))
    assert not plan(_hf_config(model, corpora, "--lr", "2e-3"), str(tmp_path / "own"), 5,
                    own_scheduler=False).from_checkpoint
    with pytest.raises(ConfigError, match=r"^--use-checkpoint-opt-param-scheduler: --load .*own \(iteration 5\) "
                                          r"stores no learning-rate schedule .*; drop the flag$"):
        plan(_hf_config(model, corpora, "--use-checkpoint-opt-param-scheduler"), str(tmp_path / "own"), 5,
             own_scheduler=False)
    blackbox = ["--task", "pretraining", "--pretrained-model-name-or-path", model, "--micro-batch-size", "4",
                "--global-batch-size", "8", "--seq-length", "64", "--tokenizer-type", "BertWordPieceLowerCase",
                "--vocab-file", corpora["wp_vocab"], "--data-path", corpora["bert"], "--split", "980,20", "--lr",
                "1e-3", "--lr-warmup-iters", "2", "--load", ck, "--save", ck]
    with pytest.raises(UsageError, match=f"^--load {re.escape(ck)} \\(iteration 10\\) continues a learning-rate "
                                         "schedule that this run's flags change: lr decay over 10 iterations in the "
                                         "checkpoint, 12 here: --train-iters 12"):
        check(parse_args([*blackbox, "--train-iters", "12"]), 1)
    check(parse_args([*blackbox, "--train-iters", "12", "--override-opt-param-scheduler"]), 1)


def _lr(step, lr, min_lr, warmup, decay, style):
    """The Hugging Face PreTrainer's schedule written out: the rate of optimizer step `step` (from 0)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / (decay - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if style == "cosine" else 1 - progress
    return min_lr + (lr - min_lr) * shape


def _resume_at_5(hf_run, tmp_path):
    ck = str(tmp_path / "ck")
    shutil.copytree(hf_run["save"], ck)
    with open(os.path.join(ck, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("5")
    return ck


def test_hf_override_continues_with_the_new_schedule(corpora, hf_run, tmp_path):
    """(~15 s: 7 iterations, one worker.) --override-opt-param-scheduler from iteration 5 with a longer run and
    every schedule flag changed: iterations 6-12 use the new schedule's rates at those steps (the formula written
    out here), the first one included (it ran at the saved schedule's rate); iteration 6 still starts from the
    checkpoint (its loss is the uninterrupted run's); the next checkpoint stores the new settings and weight decay."""
    ck, out = _resume_at_5(hf_run, tmp_path), str(tmp_path / "out")
    metrics = str(tmp_path / "m.jsonl")
    new = dict(lr=2e-3, min_lr=1e-4, warmup=3, decay=12, style="cosine")
    proc = rapidformer(*_ckpt_flags(hf_run["model"], corpora, "--load", ck, "--save", out, "--metrics-file", metrics,
                                    "--train-iters", "12", "--lr", "2e-3", "--min-lr", "1e-4", "--lr-warmup-iters",
                                    "3", "--lr-decay-style", "cosine", "--weight-decay", "0.1",
                                    "--override-opt-param-scheduler"))
    assert proc.returncode == 0, explain(proc)
    assert "at iteration 5" in proc.stdout and "lr schedule: this run's flags (--override-opt-param-scheduler)" in \
        proc.stdout
    resumed = _train(_lines(metrics))
    assert [x["iteration"] for x in resumed] == list(range(6, 13))
    for x in resumed:
        assert x["lr"] == pytest.approx(_lr(x["iteration"] - 1, **new), rel=1e-12), x
    assert abs(resumed[0]["loss"] - _train(hf_run["lines"])[5]["loss"]) < 1e-6
    from megatron_patch.config.checkpoint_layout import read_manifest

    saved = read_manifest(os.path.join(out, "iter_0000012"))
    assert saved["scheduler"]["max_lr"] == 2e-3 and saved["scheduler"]["lr_decay_steps"] == 12 * 8
    assert saved["scheduler"]["start_wd"] == 0.1
    state = torch.load(os.path.join(out, "iter_0000012", "train_state.pt"), weights_only=True)
    assert state["weight_decay"] == [0.1, 0.0]  # this run's, on the groups that decay (not biases and norms)


def test_hf_use_checkpoint_continues_like_the_uninterrupted_run(corpora, hf_run, tmp_path):
    """(~12 s: 5 iterations, one worker.) --use-checkpoint-opt-param-scheduler with other --lr, --min-lr, style,
    warmup and --weight-decay: iterations 6-10 are the uninterrupted run's (rates, losses, gradient norms,
    validation losses), and the next checkpoint stores the checkpoint's settings and weight decay."""
    ck, out = _resume_at_5(hf_run, tmp_path), str(tmp_path / "out")
    metrics = str(tmp_path / "m.jsonl")
    proc = rapidformer(*_ckpt_flags(hf_run["model"], corpora, "--load", ck, "--save", out, "--metrics-file", metrics,
                                    "--lr", "5e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "1", "--lr-decay-style",
                                    "cosine", "--weight-decay", "0.1", "--use-checkpoint-opt-param-scheduler"))
    assert proc.returncode == 0, explain(proc)
    assert ("lr schedule: the checkpoint's (--use-checkpoint-opt-param-scheduler: --lr 0.001, --min-lr 0, warmup 2, "
            "linear decay over 10 iterations, --weight-decay 0.01)") in proc.stdout, explain(proc)
    resumed = _lines(metrics)
    _same(_train(hf_run["lines"])[5:], _train(resumed), 1e-6)
    whole_val, resumed_val = _validation(hf_run["lines"])[2:], _validation(resumed)
    assert [i for i, _ in resumed_val] == [i for i, _ in whole_val] == [6, 8, 10]
    assert all(abs(a - b) <= 1e-6 for (_, a), (_, b) in zip(whole_val, resumed_val)), (whole_val, resumed_val)
    from megatron_patch.config.checkpoint_layout import read_manifest

    stored = read_manifest(os.path.join(hf_run["save"], "iter_0000010"))["scheduler"]
    assert read_manifest(os.path.join(out, "iter_0000010"))["scheduler"] == stored
    state = torch.load(os.path.join(out, "iter_0000010", "train_state.pt"), weights_only=True)
    assert state["weight_decay"] == [0.01, 0.0]


def test_hf_pretrainer_refusals_are_one_line_exit_2(corpora, hf_run, tmp_path):
    """(~15 s: two workers.) Through `rapidformer`, no traceback: a --load without a checkpoint (CheckpointError,
    two workers under torchrun: each worker reports it, the launcher prints it once). (A changed schedule's refusal:
    its words in process, test_hf_resume_refuses_a_changed_schedule; a ConfigError of PreTrainer.train() on one
    worker as one line with exit 2, test_tensor_parallelism_with_a_hugging_face_model_is_refused's --epochs.)"""
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    proc = rapidformer(*_ckpt_flags(hf_run["model"], corpora, "--load", empty, "--save", str(tmp_path / "out"),
                                    "--nproc-per-node", "2"))
    assert proc.returncode == 2, explain(proc)
    # the last line, once (the workers' start-up log lines come before it)
    lines = proc.stderr.splitlines()
    assert lines[-1] == (f"rapidformer: error: --load {empty}: no checkpoint there (no latest_checkpointed_iteration"
                         ".txt, no iter_XXXXXXX directory); give the --save directory of an earlier run to resume, "
                         "or drop --load"), explain(proc)
    assert sum("no checkpoint there" in line for line in (proc.stdout + proc.stderr).splitlines()) == 1
    assert "Traceback" not in proc.stdout + proc.stderr and "ChildFailedError" not in proc.stdout + proc.stderr


def test_hf_checkpoint_loads_an_optimizer_with_an_empty_param_group(tmp_path):
    """(< 3 s, in process.) A ZeRO-1 worker's local optimizer holds an empty param group when the partition gives
    all of a group's parameters to other workers (DCP's set_state_dict alone fails on it: the 2-worker ZeRO-1 resume
    crashed). Saved and loaded into a fresh model and optimizer: weights, Adam state, every group's
    hyper-parameters and the empty group come back."""
    from megatron_patch.accelerations.precision import Precision
    from megatron_patch.training.checkpoint.torch_dcp import load_checkpoint, save_checkpoint

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        optimizer = torch.optim.AdamW([{"params": list(model[0].parameters()), "weight_decay": 0.0},
                                       {"params": [], "weight_decay": 0.0},
                                       {"params": list(model[1].parameters()), "weight_decay": 0.1}], lr=1e-2)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (s + 1))

    model, optimizer, scheduler = build(0)
    for _ in range(3):
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    save_checkpoint(str(tmp_path), 3, model, optimizer, scheduler, Precision(None, "cpu"), 24, 8)
    model2, optimizer2, scheduler2 = build(1)
    state = load_checkpoint(str(tmp_path), 3, model2, optimizer2, scheduler2, Precision(None, "cpu"))
    assert (state["iteration"], state["consumed_samples"], state["consumed_valid_samples"]) == (3, 24, 8)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
        assert all(torch.equal(optimizer.state[a][k], optimizer2.state[b][k]) for k in optimizer.state[a])
    assert [len(g["params"]) for g in optimizer2.param_groups] == [2, 0, 2]
    assert [(g["lr"], g["weight_decay"]) for g in optimizer2.param_groups] == \
        [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups]
    assert scheduler2.last_epoch == 3


def test_hf_pretrainer_two_worker_zero1_checkpoint_resumes_on_one_worker(corpora, tmp_path):
    """(~35 s: 2 workers, then 1.) The BERT sample with ZeRO-1 on 2 workers (each saves only its optimizer
    shard's entries), 4 samples per worker; resumed from iteration 5 on 1 worker with 2 micro batches of 4 (the
    same global batch of 8, the same grouping: the same loss mathematically). Dropout off (the random streams
    start from --seed at another worker count, said in the log). Iterations 6-10 and the validation losses
    within 1e-5 of the 2-worker run."""
    from transformers import BertConfig, BertForPreTraining

    from finetune_utils import minilm_dir

    model_dir = str(tmp_path / "bert")
    torch.manual_seed(0)
    BertForPreTraining(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)).save_pretrained(model_dir)
    shutil.copy(os.path.join(minilm_dir(), "vocab.txt"), model_dir)
    two = str(tmp_path / "two")
    proc = rapidformer(*_ckpt_flags(model_dir, corpora, "--nproc-per-node", "2", "--zero-1-memory-optimization",
                                    "--save", two))
    assert proc.returncode == 0, explain(proc)
    assert "ZeroRedundancyOptimizer" in proc.stdout
    with open(os.path.join(two, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("5")
    one = str(tmp_path / "one.jsonl")
    proc = rapidformer(*_ckpt_flags(model_dir, corpora, "--load", two, "--save", str(tmp_path / "one"),
                                    "--metrics-file", one))
    assert proc.returncode == 0, explain(proc)
    assert "saved by 2 worker(s), resumed by 1: model and optimizer resharded" in proc.stdout, explain(proc)
    assert "random streams start from --seed" in proc.stdout
    whole, resumed = _lines(os.path.join(two, "metrics.jsonl")), _lines(one)
    _same(_train(whole)[5:], _train(resumed), 1e-5)
    w_val, r_val = _validation(whole), _validation(resumed)
    assert [i for i, _ in r_val] == [6, 8, 10]
    for (i, a), (j, b) in zip(w_val[2:], r_val):
        assert i == j and abs(a - b) <= 1e-5, (w_val, r_val)


# ---- dynamic-shape: contiguous micro batches, and the split across workers ----------------------------------------
def _synthetic_batches(lengths, micro_batch_size, seq_length, vocab=100, first_id=0):
    """Fixed-shape BERT-style micro batches of `micro_batch_size` samples with the given real lengths."""
    g = torch.Generator().manual_seed(len(lengths) + first_id)
    out = []
    for start in range(0, len(lengths), micro_batch_size):
        rows = lengths[start:start + micro_batch_size]
        mask = torch.zeros(len(rows), seq_length, dtype=torch.int64)
        for r, n in enumerate(rows):
            mask[r, :n] = 1
        ids = torch.randint(1, vocab, (len(rows), seq_length), generator=g) * mask
        labels = torch.where((torch.rand(len(rows), seq_length, generator=g) < 0.15) & mask.bool(), ids, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
                    "labels": labels, "next_sentence_label": torch.randint(0, 2, (len(rows),), generator=g),
                    "sample_id": torch.arange(first_id + start, first_id + start + len(rows))})
    return out


def test_dynamic_shape_micro_batches_are_contiguous_at_seq_512():
    """(~5 s.) At --seq-length 512 the micro batches are cut to widths below 512 (a strided slice of each
    [samples, 512] tensor); they are contiguous, so transformers' BERT takes them with labels
    (labels.view(-1) failed on the slice: the seed's PreTrainer sample at 512)."""
    from transformers import BertConfig, BertForPreTraining

    from megatron_patch.data.dynamic_shape import StepBuckets

    fixed = _synthetic_batches([30, 100, 200, 500, 40, 60, 300, 20], 4, 512)
    dyn = StepBuckets(iter(fixed), accum=2, micro_batch_size=4, seq_length=512, multiple=64)
    batches = [next(dyn) for _ in range(dyn.next_step())]
    assert any(b["input_ids"].shape[0] > 1 and b["input_ids"].shape[1] < 512 for b in batches)
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=64, max_position_embeddings=512)).train(False)
    for b in batches:
        assert all(v.is_contiguous() for v in b.values())
        with torch.no_grad():
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                        token_type_ids=b["token_type_ids"], labels=b["labels"],
                        next_sentence_label=b["next_sentence_label"])
        assert torch.isfinite(out.loss)


def _per_sample(batch, table):
    """A per-sample value of the real tokens only (what a loss with masked padding is), averaged over the micro
    batch as a loss is."""
    mask = batch["attention_mask"].float()
    return ((table[batch["input_ids"]] * mask).sum(1) / mask.sum(1)).mean()


def _equalize_worker(rank, store, out_dir, steps):
    import torch.distributed as dist

    from megatron_patch.data.packing import bucket_by_length
    from megatron_patch.data.dynamic_shape import StepBuckets

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        table = torch.randn(100, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        fixed = [b for k, step in enumerate(steps) for b in _synthetic_batches(step[rank], 2, 256,
                                                                               first_id=1000 * rank + 8 * k)]
        dyn = StepBuckets(iter(fixed), accum=4, micro_batch_size=2, seq_length=256, multiple=16)
        result = []
        for k, step in enumerate(steps):
            own = len(bucket_by_length(step[rank], 2 * 256, 16))
            n = dyn.next_step()
            batches = [next(dyn) for _ in range(n)]
            ids = sorted(i for b in batches for i in b["sample_id"].tolist())
            dynamic = sum(w * _per_sample(b, table) for w, b in zip(dyn.weights, batches)).item()
            reference = sum(_per_sample(b, table) for b in fixed[4 * k:4 * k + 4]).item() / 4
            result.append({"groups": own, "micro_batches": n, "ids": ids, "weights": sum(dyn.weights),
                           "dynamic": dynamic, "fixed": reference})
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_dynamic_shape_splits_micro_batches_equally_across_two_workers(tmp_path):
    """(~10 s: 2 processes, gloo.) Two steps of 8 samples per worker (4 micro batches of 2, seq 256): one worker
    has long samples (4 micro batches after bucketing), the other short ones (1), then the reverse. `_equalize`
    splits the fewer: both run 4 micro batches, each keeps its 8 samples once, the weights sum to 1 and the
    step's weighted loss equals fixed-shape's."""
    import torch.multiprocessing as mp

    steps = [([250] * 8, [10, 12, 9, 11, 14, 10, 13, 8]), ([20, 9, 15, 11, 12, 10, 16, 7], [240, 230, 255, 200] * 2)]
    mp.spawn(_equalize_worker, args=(str(tmp_path / "store"), str(tmp_path), steps), nprocs=2, join=True)
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for k in range(len(steps)):
        a, b = ranks[0][k], ranks[1][k]
        assert sorted([a["groups"], b["groups"]]) == [1, 4], (a, b)  # one worker must split
        assert a["micro_batches"] == b["micro_batches"] == 4
        for r, x in enumerate((a, b)):
            assert x["ids"] == list(range(1000 * r + 8 * k, 1000 * r + 8 * k + 8))
            assert abs(x["weights"] - 1) < 1e-12 and abs(x["dynamic"] - x["fixed"]) < 1e-9, x


DYING_SCRIPT = """
import os, runpy, signal, sys
from megatron_patch.templates import torch_loop

call = torch_loop.TrainStep.__call__
steps = [0]


def dying(self, *a, **k):
    steps[0] += 1  # iterations of this attempt
    if steps[0] == 7 and os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    return call(self, *a, **k)


torch_loop.TrainStep.__call__ = dying
sys.argv[0] = SAMPLE
runpy.run_path(SAMPLE, run_name="__main__")
"""


@pytest.mark.slow
def test_rapidformer_max_restarts_resumes_a_killed_pretraining_like_an_uninterrupted_run(corpora, tmp_path):
    """(~60 s.) rapidformer --max-restarts 1 on the how-to's BERT PreTrainer sample, 2 workers, dropout on: rank 1
    killed before iteration 7 on the first attempt; the job resumes from iteration 5 by itself and ends (exit 0) with
    the losses of an uninterrupted 2-worker run within 1e-6."""
    model = tiny_model("bert", str(tmp_path / "bert"))
    straight = str(tmp_path / "straight")
    proc = rapidformer(*_ckpt_flags(model, corpora, "--save", straight, "--nproc-per-node", "2"))
    assert proc.returncode == 0, explain(proc)
    dying = tmp_path / "dying.py"
    dying.write_text(f"SAMPLE = {BERT_SAMPLE!r}\n" + DYING_SCRIPT)
    save = str(tmp_path / "faulty")
    flags = _ckpt_flags(model, corpora, "--save", save, "--nproc-per-node", "2", "--max-restarts", "1")
    flags[flags.index(BERT_SAMPLE)] = str(dying)
    proc = rapidformer(*flags)  # the dying wrapper runs the sample
    assert proc.returncode == 0, explain(proc)
    assert (f"restart 1 of 1 (torchrun --max-restarts): resuming from iteration 5, the newest complete checkpoint in "
            f"{save}") in proc.stdout, explain(proc)
    want = {x["iteration"]: x["loss"] for x in _train(_lines(os.path.join(straight, "metrics.jsonl")))}
    got = {x["iteration"]: x["loss"] for x in _train(_lines(os.path.join(save, "metrics.jsonl")))}
    assert sorted(got) == sorted(want) == list(range(1, 11))
    assert [got[i] for i in range(1, 11)] == pytest.approx([want[i] for i in range(1, 11)], rel=1e-6)
