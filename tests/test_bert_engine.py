"""BERT pretraining on the engine (pretrain_megatron_bert.py, run_bert.sh): masked LM + next-sentence losses,
parallel layouts equal to one process, exact resume, and configuration mistakes refused in words.

Data: the test corpus (stdlib docstrings) split into sentences and tokenized with the real MiniLM WordPiece
vocabulary. Layouts start from the same weights (--init-layout-invariant), dropout off, the same batches.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import run_tool
from engine_utils import ROOT, per_iteration, run_engine

BERT = os.path.join(ROOT, "pretrain_megatron_bert.py")
# 4 layers so PP2 has two per stage; 6 iterations, a checkpoint every 3 (the resume test starts from iteration 3).
FLAGS = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
         "--global-batch-size 8 --train-iters 6 --lr 1e-3 --lr-decay-style constant --log-interval 1 "
         "--eval-interval 3 --eval-iters 1 --hidden-dropout 0 --attention-dropout 0 --init-layout-invariant --seed 7 --split 98,2,0").split()


@pytest.fixture(scope="module")
def bert_flags(corpus, minilm_vocab, workdir):
    """Engine flags for a tiny BERT on the sentence-split test corpus."""
    prefix = str(workdir / "bert_engine")
    if not os.path.exists(prefix + "_text_sentence.idx"):
        run_tool("preprocess_data.py", "--input", corpus, "--output-prefix", prefix, "--tokenizer-type",
                 "BertWordPieceLowerCase", "--vocab-file", minilm_vocab, "--split-sentences", "--workers", "1")
    return [*FLAGS, "--data-path", prefix + "_text_sentence", "--vocab-file", minilm_vocab,
            "--data-cache-path", str(workdir / "bert_engine_cache")]


def run_bert(workdir, nproc, flags, *args, **kw):
    return run_engine(workdir, nproc, *args, base=flags, script=[BERT], **kw)


@pytest.fixture(scope="module")
def reference(bert_flags, tmp_path_factory):
    """(metrics lines, directory) of the single-process run, with checkpoints at iterations 3 and 6."""
    d = tmp_path_factory.mktemp("bert_tp1")
    lines, proc = run_bert(d, 1, bert_flags, "--save", str(d / "ck"), "--save-interval", "3")
    assert "lm loss" in proc.stdout and "sop loss" in proc.stdout  # the log line names both
    return lines, d


def assert_same_run(lines, ref_lines, rel=1e-5):
    for key in ("loss", "lm_loss", "sop_loss", "grad_norm"):
        got, want = per_iteration(lines, key), per_iteration(ref_lines, key)
        assert len(got) == len(want) == 6, key
        assert got == pytest.approx(want, rel=rel), key


def test_single_process_trains_both_objectives(reference):
    lines, _ = reference
    lm, nsp, loss = (per_iteration(lines, k) for k in ("lm_loss", "sop_loss", "loss"))  # sop: Megatron-LM's name
    assert all(a + b == pytest.approx(c, rel=1e-6) for a, b, c in zip(lm, nsp, loss))  # objective = LM + NSP
    assert 9 < lm[0] < 11.5 and 0.5 < nsp[0] < 0.9  # ln(30522) = 10.3; ln(2) = 0.69
    assert lm[-1] < lm[0] - 0.1  # learns
    valid = [x for x in lines if "valid_loss" in x]
    assert valid and all(x["valid_loss"] == pytest.approx(x["valid_lm_loss"] + x["valid_sop_loss"]) for x in valid)


LAYOUTS = {  # name -> (processes, flags)
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),  # token types, labels, masks broadcast over TP
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),  # the last stage needs the padding mask and labels
    "dp2_zero1": (2, ["--zero-1-memory-optimization"]),
    "tp2_pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
}
# CI time: tp2 (token types and masks broadcast over TP) and pp2 (the last stage's attention masks the padding:
# the default lane's only guard of it, 2 processes) are the fast ones
SLOW = ("dp2_zero1", "tp2_pp2")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if n in SLOW else ()) for n in LAYOUTS])
def test_layout_matches_single_process(name, reference, bert_flags, tmp_path):
    nproc, args = LAYOUTS[name]
    lines, _ = run_bert(tmp_path, nproc, bert_flags, *args, torchrun=False)
    assert_same_run(lines, reference[0])


@pytest.mark.slow  # CI time: the checkpoint machinery is the GPT engine's (tests/test_engine_checkpoint.py)
def test_resume_is_exact(reference, bert_flags, tmp_path):
    """Iteration 3's checkpoint, resumed: iterations 4..6 as in the uninterrupted run (data position, optimizer)."""
    ref_lines, d = reference
    ck = tmp_path / "ck"
    shutil.copytree(d / "ck", ck)
    shutil.rmtree(ck / "iter_0000006")
    (ck / "latest_checkpointed_iteration.txt").write_text("3")
    lines, proc = run_bert(tmp_path, 1, bert_flags, "--load", str(ck))
    assert "(iteration 3)" in proc.stdout
    for key in ("lm_loss", "sop_loss", "grad_norm"):
        want = [x[key] for x in ref_lines if key in x and x["iteration"] > 3]
        assert per_iteration(lines, key) == pytest.approx(want, rel=1e-6), key


@pytest.mark.slow
def test_zero2_trains_like_one_process_and_resumes_exactly(reference, bert_flags, tmp_path):
    """DP2 ZeRO-2 (Megatron-FSDP, its own checkpoint format naming BertModel's encoder layers): the single
    process's iterations, and a resume from iteration 3 continues them."""
    zero2 = ["--zero-2-memory-optimization"]
    lines, _ = run_bert(tmp_path / "s", 2, bert_flags, *zero2, "--save", str(tmp_path / "ck"), "--save-interval", "3")
    assert_same_run(lines, reference[0])
    shutil.rmtree(tmp_path / "ck" / "iter_0000006")
    (tmp_path / "ck" / "latest_checkpointed_iteration.txt").write_text("3")
    resumed, proc = run_bert(tmp_path / "r", 2, bert_flags, *zero2, "--load", str(tmp_path / "ck"))
    assert "(iteration 3)" in proc.stdout
    for key in ("lm_loss", "sop_loss", "grad_norm"):
        want = [x[key] for x in lines if key in x and x["iteration"] > 3]
        assert per_iteration(resumed, key) == pytest.approx(want, rel=1e-6), key


@pytest.mark.slow  # CI time (10 s); the forward-step test covers the loss without NSP logits
def test_no_binary_head_trains_masked_lm_only(reference, bert_flags, tmp_path):
    flags = list(bert_flags)
    flags[flags.index("--train-iters") + 1] = "2"
    lines, proc = run_bert(tmp_path, 1, flags, "--bert-no-binary-head")
    assert "sop loss" not in proc.stdout and "iteration      2/2 | loss " in proc.stdout
    assert len(per_iteration(lines, "loss")) == 2 and not any("sop_loss" in x or "lm_loss" in x for x in lines)
    # No next-sentence head: pooler 64x64 + 64, binary head 2x64 + 2.
    params = [x["num_params"] for x in lines if "num_params" in x]
    ref_params = [x["num_params"] for x in reference[0] if "num_params" in x]
    assert ref_params[0] - params[0] == 64 * 64 + 64 + 2 * 64 + 2


def test_forward_step_feeds_the_model_and_adds_both_losses():
    """The forward step alone, on a stand-in model (one process, no tensor parallelism): tokens, token types,
    padding mask and labels reach the model, and the loss is the masked-mean LM loss plus the NSP loss."""
    from megatron_patch.training.bert import BATCH_KEYS, bert_forward_step

    g = torch.Generator().manual_seed(0)
    batch = {"text": torch.randint(5, 50, (2, 4), generator=g), "types": torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]]),
             "labels": torch.randint(5, 50, (2, 4), generator=g), "is_random": torch.tensor([0, 1]),
             "loss_mask": torch.tensor([[1, 0, 1, 0], [0, 0, 1, 0]]),
             "padding_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])}
    lm_losses = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    seen = {}

    def model(tokens, padding_mask, tokentype_ids=None, lm_labels=None):
        seen.update(text=tokens, padding_mask=padding_mask, types=tokentype_ids, labels=lm_labels)
        return lm_losses, logits

    output, loss_func = bert_forward_step(iter([{k: batch[k] for k in BATCH_KEYS}]), model)
    for key in ("text", "types", "padding_mask", "labels"):
        assert torch.equal(seen[key], batch[key]), key
    total, parts = loss_func(output)
    nsp = torch.nn.functional.cross_entropy(logits, batch["is_random"]).item()
    assert parts["lm loss"].item() == pytest.approx((1 + 3 + 7) / 3)
    assert parts["sop loss"].item() == pytest.approx(nsp)
    assert total.item() == pytest.approx((1 + 3 + 7) / 3 + nsp)
    total, parts = loss_func((lm_losses, None))  # --bert-no-binary-head: no NSP logits
    assert set(parts) == {"lm loss"} and total.item() == pytest.approx(11 / 3)
    total /= 2  # as the schedule does: the reported loss must not change with it
    assert parts["lm loss"].item() == pytest.approx(11 / 3)


def test_configuration_mistakes_are_refused_in_words(bert_flags, tmp_path):
    from megatron_patch.config import ConfigError, parse_args
    from megatron_patch.config.validate import validate_bert_pretraining

    def refused(*args, model="bert"):
        with pytest.raises(ConfigError) as e:
            cfg = parse_args([*bert_flags, *args], model=model).validate(1)
            validate_bert_pretraining(cfg)
        return str(e.value)

    assert "BertWordPieceLowerCase or BertWordPieceCase" in refused("--tokenizer-type", "GPT2BPETokenizer")
    assert "no --mock-data" in refused("--mock-data")
    assert "--mask-prob 1.5 must be between 0 and 1" in refused("--mask-prob", "1.5")
    assert "--num-experts" in refused("--num-experts", "4", "--disable-bias-linear")
    assert "--model-family llama: pretrain_megatron_bert.py trains BERT" in refused("--model-family", "llama")
    assert "applies to BERT pretraining" in refused("--bert-no-binary-head", model="gpt")
    assert "pretrain_megatron_bert.py" in refused("--model-family", "bert", model="gpt")
    c = parse_args(["--model-size", "base", *bert_flags], model="bert").validate(1)
    assert (c.model_family, c.hidden_size, c.norm_epsilon) == ("bert", 64, 1e-12)  # flags win over the base preset
    assert c.tokenizer_type == "BertWordPieceLowerCase"  # Megatron-LM's default for BERT
    # As users meet it: one line on stderr, exit status 2, before torch is imported.
    proc = subprocess.run([sys.executable, BERT, *bert_flags, "--tensor-model-parallel-size", "3"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "configuration error: --num-attention-heads 4" in proc.stderr, proc.stderr


def test_data_without_sentence_pairs_is_refused(tmp_path):
    """Data tokenized without --split-sentences (one sequence per document) has no next-sentence pairs."""
    from megatron_patch.data.checks import DataError, check_bert_documents
    from megatron_patch.data.indexed_dataset import IndexedDatasetWriter

    prefix = str(tmp_path / "docs_text_document")
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for i in range(50):
            w.add_document([[5, 6, 7, i + 8]])
        w.finalize()
    with pytest.raises(DataError, match="--split-sentences"):
        check_bert_documents([prefix], "98,2,0", binary_head=True)
    check_bert_documents([prefix], "98,2,0", binary_head=False)  # masked LM alone needs no pairs


@pytest.mark.slow  # about 2-3 minutes on 2 CPU cores: data preparation and 300 iterations
def test_run_bert_sh_defaults_both_losses_fall(tmp_path):
    env = dict(os.environ, OUTPUT=str(tmp_path / "out"), DEMO_DIR=str(tmp_path / "demo"), PYTHONWARNINGS="ignore")
    for name in ("TRAIN_ITERS", "WARMUP", "SAVE_INTERVAL", "GPUS", "TP", "PP", "MBS", "SEQ_LEN", "LR", "DATA_PATH"):
        env.pop(name, None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "pretrain_scripts", "run_bert.sh")], capture_output=True,
                          text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in open(tmp_path / "out" / "metrics.jsonl")]
    lm, nsp = per_iteration(lines, "lm_loss"), per_iteration(lines, "sop_loss")
    assert len(lm) == len(nsp) == 300
    first, last = slice(0, 30), slice(-30, None)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    # Measured (2 CPU cores): lm 8.19 -> 6.11, sop 0.695 -> 0.512 (means of the first and last 30 iterations).
    assert mean(lm[last]) < mean(lm[first]) - 1.5, (mean(lm[first]), mean(lm[last]))
    assert mean(nsp[last]) < mean(nsp[first]) - 0.08, (mean(nsp[first]), mean(nsp[last]))
    assert "lm loss" in proc.stdout and "sop loss" in proc.stdout and "validation at iteration 300" in proc.stdout
    assert (tmp_path / "out" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "300"


@pytest.mark.slow  # inductor compiles the BERT layer on 2 cores: about a minute
def test_compile_builds_one_graph_and_matches_eager(reference, bert_flags, tmp_path):
    """--compile on BERT (post-norm layers, padding mask, two losses): one graph for all four layers in training
    and one more for evaluation (iteration 3: eval mode without gradients), nothing recompiled after that, and
    eager's losses within fp32 reduction-order noise."""
    lines, proc = run_bert(tmp_path, 1, bert_flags, "--compile")
    assert "torch.compile: 4 transformer layers compiled" in proc.stdout
    graphs = per_iteration(lines, "compiled_graphs")
    assert graphs == [1, 1, 1, 2, 2, 2], graphs
    assert_same_run(lines, reference[0], rel=1e-5)
