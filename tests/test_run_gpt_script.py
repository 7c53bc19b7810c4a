"""pretrain_scripts/run_gpt.sh as a new user runs it: demo data built offline, a tiny GPT trains, loss falls."""
import json
import os
import re
import subprocess

import numpy as np
import pytest

from engine_utils import ROOT


def test_run_gpt_sh_defaults_train_and_save(gpt_demo):
    """The demo as a user runs it (conftest's gpt_demo: demo data built offline, 60 iterations), with the iteration
    count on the command line (TRAIN_ITERS keeps its 300): what derives from it (warmup 1/15, one checkpoint at the
    end) must follow the flag. Its log goes to a pipe and must arrive while the job runs, not at exit. A second run
    into its checkpoints is refused before launch."""
    tmp_path, arrivals = gpt_demo.dir, gpt_demo.arrivals
    stdout, stderr, returncode = gpt_demo.stdout, gpt_demo.stderr, gpt_demo.returncode
    assert returncode == 0, stderr[-4000:]
    lines = [json.loads(x) for x in open(tmp_path / "out" / "metrics.jsonl")]
    losses = [x["loss"] for x in lines if "loss" in x]
    assert len(losses) == 60
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 1.0  # clearly learning the demo corpus
    lrs = [x["lr"] for x in lines if "lr" in x]
    assert lrs.index(max(lrs)) == 4 and max(lrs) == pytest.approx(1e-3)  # warmup 4 = 60 / 15 iterations
    assert "validation at iteration 60" in stdout and "tokens/s" in stdout
    assert (tmp_path / "out" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "60"
    assert sorted(os.listdir(tmp_path / "out" / "checkpoints")) == ["iter_0000060", "latest_checkpointed_iteration.txt"]
    assert os.listdir(tmp_path / "out" / "tensorboard")
    # Streamed: the line of iteration 10 arrived while iterations 11..60 were still to run, so at least (about)
    # their step times before the line of iteration 60. Buffered, the lines would arrive together (at exit).
    arrived = {line.split()[1]: t for t, line in arrivals if line.startswith("iteration")}
    steps = sum(x["step_time"] for x in lines if 10 < x.get("iteration", 0) <= 60 and "step_time" in x)
    gap = arrived["60/60"] - arrived["10/60"]
    assert gap > max(0.5 * steps, 0.1), f"iterations 11-60 took {steps:.2f} s, their log lines came {gap:.2f} s apart"
    # The log file it names holds what it printed, stdout and stderr.
    (log,) = re.findall(r"run_gpt\.sh: 1 node\(s\) x 1 process\(es\), log in (\S+)\n", stderr)
    assert os.path.dirname(log) == str(tmp_path / "out" / "logs")
    assert os.listdir(tmp_path / "out" / "logs") == [os.path.basename(log)]
    text = open(log).read()
    assert "configuration ok for 1 process(es)" in text and "validation at iteration 60" in text
    assert all(line in text for _, line in arrivals if line.startswith("iteration"))
    # A second run never writes into these checkpoints unless it resumes them (--load); refused before launch, it
    # leaves no log. (Each --validate-only launch: a few seconds.)
    again = dict(DEMO_DIR=str(tmp_path / "demo"))
    rc, err = _launch(tmp_path, "--train-iters", "60", "--validate-only", **again)
    ck = tmp_path / "out" / "checkpoints"
    assert rc == 2 and err == (f"configuration error: --save {ck} already holds checkpoints of this model and layout "
                               f"(iteration 60): a run never writes over another run's checkpoints. Resume that run "
                               f"with --load {ck}, or choose a new --save directory (pretrain_scripts/run_gpt.sh: "
                               f"OUTPUT=DIR)\n")
    rc, err = _launch(tmp_path, "--train-iters", "60", GPUS="2", TP="2", **again)  # the TP2 run
    assert rc == 2 and err.startswith(f"configuration error: --save {ck} already holds the checkpoints of another run "
                                      f"(iteration 60; TP 1 there, 2 here)") and err.count("\n") == 1, err
    rc, err = _launch(tmp_path, "--train-iters", "60", "--validate-only", MODEL_FAMILY="llama", **again)
    assert rc == 2 and "--model-family gpt there, llama here" in err, err
    assert len(os.listdir(tmp_path / "out" / "logs")) == 1
    rc, err = _launch(tmp_path, "--train-iters", "60", "--load", str(ck), "--validate-only", **again)  # resume: in place
    assert rc == 0 and f"checkpoints to {ck} at the end" in err, err
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "60"


def _launch(tmp_path, *args, script="run_gpt.sh", **env):
    """run_gpt.sh as a user runs it; returns (exit status, stderr)."""
    full = dict(os.environ, OUTPUT=str(tmp_path / "out"), PYTHONWARNINGS="ignore", **env)
    for name in ("TRAIN_ITERS", "WARMUP", "GBS", "SAVE_INTERVAL", "PRECISION", "DATA_PATH", "GPUS", "TP", "PP",
                 "MODEL_FAMILY", "MODEL_SIZE", "HF_MODEL", "SAVE"):
        if name not in env:
            full.pop(name, None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "pretrain_scripts", script), *args], capture_output=True,
                          text=True, env=full, timeout=300)
    return proc.returncode, proc.stderr


def test_run_gpt_sh_flags_win_over_the_launcher_defaults(tmp_path):
    """A flag after the launcher's own wins, and every default that depends on it is derived from the final
    flags (in Python), not from the launcher's variables."""
    def settings(*args, **env):
        rc, err = _launch(tmp_path, "--mock-data", *args, "--validate-only", **env)
        assert rc == 0, err
        return err

    six = settings("--train-iters", "6")  # the warmup default (20 of 300) used to refuse this
    assert "6 iterations, lr 0.001 warmup 0 (--lr-warmup-fraction 0.0667) cosine decay over 6" in six
    assert "checkpoints to " + str(tmp_path / "out" / "checkpoints") + " at the end" in six
    assert "300 iterations, lr 0.001 warmup 20 (--lr-warmup-fraction 0.0667)" in settings()
    assert "warmup 2 cosine" in settings("--train-iters", "6", "--lr-warmup-iters", "2")
    assert "warmup 150 (--lr-warmup-fraction 0.5)" in settings("--lr-warmup-fraction=0.5")
    assert "warmup 10 cosine" in settings(WARMUP="10")
    assert "micro batch 3 x 1 x DP 2 = global batch 6" in settings("--micro-batch-size", "3", GPUS="2")
    assert "TP 2 x PP 1 x DP 1, micro batch 8 x 1 x DP 1 = global batch 8" in settings(
        "--tensor-model-parallel-size", "2", GPUS="2")
    assert "micro batch 8 x 4 x DP 1 = global batch 32" in settings(GBS="32")
    assert "seq 256" in settings("--seq-length", "256")  # max positions follow the final sequence length
    assert "every 2 iterations and at the end" in settings("--save-interval", "2")
    assert ", fp16, " in settings("--fp16") and ", bf16, " in settings("--bf16")  # whatever PRECISION defaults to


def test_run_gpt_sh_one_gpu_memory_preset(tmp_path):
    """MEMORY=one-gpu: bf16 gradients, bf16 Adam moments in the fused kernel, full recompute, the chunked loss; the
    configuration it makes passes the engine's checks (the Triton kernel's interpreter stands in for a GPU)."""
    rc, err = _launch(tmp_path, "--mock-data", "--validate-only", MEMORY="one-gpu", MODEL_FAMILY="llama",
                      TRITON_INTERPRET="1")
    assert rc == 0, err
    assert "bf16, recompute full, Adam moments bf16/bf16, bf16 gradients, ZeRO-0" in err, err
    rc, err = _launch(tmp_path, "--mock-data", "--validate-only", MEMORY="lots")
    assert rc == 2 and "MEMORY=lots: the preset is one-gpu" in err


def test_run_gpt_sh_refuses_a_configuration_before_launch(tmp_path):
    rc, err = _launch(tmp_path, "--mock-data", "--tensor-model-parallel-size", "3", GPUS="2")
    assert rc == 2
    assert err.strip() == ("configuration error: --num-attention-heads 4 is not divisible by "
                           "--tensor-model-parallel-size 3; choose a TP size that divides the number of heads")
    rc, err = _launch(tmp_path, "--mock-data", GPUS="3", TP="2")
    assert rc == 2 and err.strip().startswith("configuration error: world size 3 is not divisible by "
                                              "--tensor-model-parallel-size 2")


def test_run_gpt_sh_refuses_bad_data_before_launch(tmp_path):
    from megatron_patch.data.indexed_dataset import IndexedDatasetWriter

    w = IndexedDatasetWriter(str(tmp_path / "foreign_text_document"), np.uint16)
    for i in range(100):
        w.add_document([np.arange(i, i + 50) * 90])  # ids up to 148 x 90 = 13320
    w.finalize()
    tokenizer = "--tokenizer-type NullTokenizer --vocab-size 8000"
    rc, err = _launch(tmp_path, "--split", "90,10,0", DATA_PATH=str(tmp_path / "foreign_text_document"),
                      TOKENIZER_ARGS=tokenizer)
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"data error: {tmp_path}/foreign_text_document.bin: largest token id 13320 is outside the "
                          f"tokenizer's vocabulary of 8001 (ids 0..8000), first at token ")
    assert "made with another tokenizer" in err
    rc, err = _launch(tmp_path, DATA_PATH=str(tmp_path / "foreign"), TOKENIZER_ARGS=tokenizer)
    assert rc == 2 and err.strip() == (f"data error: --data-path {tmp_path}/foreign: {tmp_path}/foreign.idx not found; "
                                       f"did you mean {tmp_path}/foreign_text_document?")


def test_run_llama_sh_with_tensor_parallel(tmp_path, gpt_demo):
    """run_llama.sh at TP2 on the demo data (the gpt_demo run built it), with MAX_RESTARTS."""
    env = dict(os.environ, TRAIN_ITERS="10", LOG_INTERVAL="5", EVAL_INTERVAL="10", OUTPUT=str(tmp_path / "out"),
               DEMO_DIR=str(gpt_demo.demo), GPUS="2", TP="2", PYTHONWARNINGS="ignore", MAX_RESTARTS="2")
    proc = subprocess.run(["bash", os.path.join(ROOT, "pretrain_scripts", "run_llama.sh"), "--save-interval", "5"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "model: llama" in proc.stdout and "TP 2 PP 1 DP 1" in proc.stdout
    assert (tmp_path / "out" / "checkpoints" / "iter_0000005").is_dir()
    # MAX_RESTARTS reaches torchrun (--max-restarts), and the run says what ends a hung job
    assert ("fault tolerance: the job ends when a worker sends no heartbeat for 60 s (--heartbeat-timeout-seconds) or "
            "a collective waits 10 min (--distributed-timeout-minutes); torchrun restarts it up to 2 time(s) "
            "(MAX_RESTARTS, --max-restarts), resuming from --save") in proc.stdout, proc.stdout[-3000:]


@pytest.mark.slow  # CI time; --load-hf itself is in the fast conversion training tests
def test_run_gpt_sh_starts_from_a_hugging_face_model(tmp_path, gpt2_files):
    """HF_MODEL=DIR: the demo corpus is tokenized with the model's own tokenizer and training starts from
    its weights, in the launcher's TP layout."""
    import torch
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    vocab, merges = gpt2_files
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=ByteLevelBPETokenizer(vocab, merges),
                                               eos_token="<|endoftext|>")
    hf = tmp_path / "tiny_llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=len(tok) + 3, max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(hf)
    tok.save_pretrained(hf)
    env = dict(os.environ, HF_MODEL=str(hf), TRAIN_ITERS="4", LOG_INTERVAL="1", EVAL_INTERVAL="4", GPUS="2", TP="2",
               OUTPUT=str(tmp_path / "out"), DEMO_DIR=str(tmp_path / "demo"), PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", os.path.join(ROOT, "pretrain_scripts", "run_gpt.sh")], capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"Hugging Face tensors from --load-hf {hf}" in proc.stdout and "TP 2 PP 1" in proc.stdout
    assert "model: llama" in proc.stdout
    lines = [json.loads(x) for x in open(tmp_path / "out" / "metrics.jsonl")]
    assert len([x for x in lines if "loss" in x]) == 4


@pytest.mark.slow  # two 50-iteration runs on the demo corpus, one compiled: about 3 minutes on 2 cores
def test_fast_configuration_tracks_the_plain_engine_over_50_steps_on_real_data(tmp_path):
    """The performance switches (--compile per layer, the fused linear cross-entropy) change how the step is
    computed, not what: a tiny Llama on the demo corpus, 50 iterations each way, fp32 on the CPU, gives the
    same losses within 1e-4 relative (reduction order only; measured 1.4e-7, loss 9.01 -> 6.99). On a GPU in bf16 the same
    comparison is tests/test_gpu.py::test_compile_matches_eager (1e-2)."""
    runs = {}
    for name, extra in (("plain", []), ("fast", ["--compile", "--cross-entropy-loss-fusion",
                                                  "--cross-entropy-fusion-impl", "linear"])):
        rc, err = _launch(tmp_path / name, "--train-iters", "50", "--eval-iters", "0", "--hidden-dropout", "0",
                          "--attention-dropout", "0", *extra, MODEL_FAMILY="llama", LOG_INTERVAL="10",
                          DEMO_DIR=str(tmp_path / "demo"))
        assert rc == 0, err[-4000:]
        runs[name] = [x["loss"] for x in map(json.loads, open(tmp_path / name / "out" / "metrics.jsonl")) if "loss" in x]
    assert len(runs["plain"]) == 50 and runs["plain"][-1] < runs["plain"][0] - 1.0
    assert runs["fast"] == pytest.approx(runs["plain"], rel=1e-4)


def test_default_output_beside_an_earlier_runs_checkpoints(tmp_path):
    """Without OUTPUT, a launcher whose default directory holds an earlier run's checkpoints writes beside it
    (BASE_2, BASE_3, ...) and says so, so a second `make demo` trains anew instead of being refused."""
    base = tmp_path / "work_dirs" / "gpt_tiny"

    def fresh(**env):
        script = f'ROOT={ROOT}; EXTRA=(); source {ROOT}/pretrain_scripts/launcher.sh; fresh_output {base}'
        proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, **env))
        assert proc.returncode == 0, proc.stderr
        return proc.stdout, proc.stderr

    assert fresh() == (str(base), "")  # nothing there yet
    (base / "checkpoints" / "iter_0000300").mkdir(parents=True)
    out, err = fresh()
    assert out == f"{base}_2" and f"{base} holds an earlier run's checkpoints" in err
    assert f"--load {base}/checkpoints" in err
    (tmp_path / "work_dirs" / "gpt_tiny_2" / "checkpoints").mkdir(parents=True)
    (tmp_path / "work_dirs" / "gpt_tiny_2" / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("10")
    assert fresh()[0] == f"{base}_3"
    assert fresh(SAVE=str(tmp_path / "elsewhere"))[0] == str(base)  # SAVE chooses where checkpoints go


@pytest.mark.slow  # CI time: each family's training is in the default lane through test_families_engine / test_moe
@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe", "deepseek_v2"])
def test_todays_family_presets_train_with_run_gpt_sh(family, tmp_path):
    """MODEL_FAMILY=F MODEL_SIZE=tiny bash pretrain_scripts/run_gpt.sh: the tiny preset of each of today's families
    trains (on the offline demo corpus) and its loss falls."""
    env = dict(os.environ, MODEL_FAMILY=family, MODEL_SIZE="tiny", TRAIN_ITERS="30", LOG_INTERVAL="10",
               EVAL_INTERVAL="30", OUTPUT=str(tmp_path / "out"), PYTHONWARNINGS="ignore")
    for name in ("DATA_PATH", "GPUS", "TP", "PP", "HF_MODEL", "SAVE", "GBS", "WARMUP"):
        env.pop(name, None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "pretrain_scripts", "run_gpt.sh"), "--lr", "3e-3"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"iteration +\d+/\d+ \| loss ([\d.]+)", proc.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.2, (family, losses)
    print(family, losses)
