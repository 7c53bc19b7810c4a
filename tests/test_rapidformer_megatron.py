"""`rapidformer` with a Megatron model (the how-to's GPT PreTrainer sample) and what a new user meets there:
mixture of experts with the flags' defaults (linear biases on), configuration errors as one line with exit
status 2 from 1 or 2 workers, --cpu-offload / --onnx-runtime-training refused in words, and each known
harmless warning printed at most once by a 2-worker run.

Budgets (2 loaded CPU cores): the 2-worker MoE run ~30 s, the engine's MoE parity pair ~30 s, each error run
~10-20 s, the rest under 10 s."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import ROOT, run_tool
from engine_utils import free_port
from finetune_utils import explain

GPT_SAMPLE = os.path.join(ROOT, "examples", "rapidformer_pretrain_megatron_gpt_trainer.py")

# Known harmless lines that a worker would print once per rank (issue 27): each at most once per run.
ONCE = ["No CUDA runtime is found", "no GPU found: running megatron-core", "full scope is deprecated",
        "GPTModel IS DEPRECATED", "MimoModelConfig is experimental", "CUDA_DEVICE_MAX_CONNECTIONS",
        "Megatron-FSDP is using device", "MCore's async save is deprecated", "Disabling sequence parallel",
        "Transformer Engine and Apex are not installed", "LOAD REPORT", "Setting OMP_NUM_THREADS"]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend's messages and gloo layouts")


@pytest.fixture(scope="module")
def gpt_corpus(tmp_path_factory, texts, minilm_vocab):
    """A small GPT document corpus (MiniLM WordPiece ids, end-of-document tokens) by tools/preprocess_data.py."""
    d = tmp_path_factory.mktemp("megatron_rf")
    with open(d / "docs.jsonl", "w") as f:
        for t in texts[:200]:
            f.write(json.dumps({"text": t}) + "\n")
    run_tool("preprocess_data.py", "--input", str(d / "docs.jsonl"), "--output-prefix", str(d / "wp"),
             "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", minilm_vocab, "--append-eod")
    return str(d / "wp_text_document"), minilm_vocab


def _sample_flags(corpus, *extra):
    data, vocab = corpus
    return ["--user-script", GPT_SAMPLE, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "32", "--max-position-embeddings",
            "32", "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab, "--data-path", data,
            "--split", "980,20", "--lr", "1e-3", "--train-iters", "2", "--log-interval", "1", "--eval-interval",
            "100", "--eval-iters", "1", *extra]


def _said_once(text: str) -> None:
    for line in ONCE:
        assert text.count(line) <= 1, f"{line!r} printed {text.count(line)} times:\n{text[-5000:]}"
    assert "Traceback" not in text, text[-5000:]


def rapidformer(*args: str) -> subprocess.CompletedProcess:
    """The `rapidformer` command as a user runs it: with Python's default warning filters (finetune_utils'
    helper hides every warning, which would hide the per-rank noise this file counts)."""
    exe = os.path.join(os.path.dirname(sys.executable), "rapidformer")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env=dict(env, TOKENIZERS_PARALLELISM="false"))


# ---- 1. mixture of experts with the defaults a user types ------------------------------------------------------------
def test_moe_sample_trains_with_default_biases_on_two_workers_quietly(gpt_corpus, tmp_path):
    """--num-experts through `rapidformer` with nothing else MoE-specific: linear biases stay on (megatron-core's
    in-place expert bias add is patched in compat), TP2 gets sequence parallelism and whole experts per rank, one
    log line says so; ZeRO-2 and --save run too. Every known per-rank message is printed at most once."""
    metrics = str(tmp_path / "m.jsonl")
    proc = rapidformer(*_sample_flags(gpt_corpus, "--num-experts", "2", "--tensor-model-parallel-size", "2",
                                      "--zero-2-memory-optimization", "--nproc-per-node", "2", "--save",
                                      str(tmp_path / "save"), "--metrics-file", metrics))
    assert proc.returncode == 0, explain(proc)
    out = proc.stdout + proc.stderr
    assert out.count("--num-experts with --tensor-model-parallel-size 2: sequence parallelism on") == 1
    assert "MoE 2 experts" in out and "EP 1 ETP 1" in out
    losses = [x["loss"] for x in map(json.loads, open(metrics)) if "loss" in x]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), losses
    _said_once(out)


def _engine(workdir, nproc: int, *args: str) -> subprocess.CompletedProcess:
    """pretrain_megatron_gpt.py under torchrun (one process: plainly, as its docstring allows), with a user's warning
    filters (engine_utils.run_engine hides them)."""
    os.makedirs(workdir, exist_ok=True)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                str(free_port())] if nproc > 1 else [sys.executable]
    cmd = [*launcher, os.path.join(ROOT, "pretrain_megatron_gpt.py"), *args,
           "--metrics-file", os.path.join(str(workdir), "metrics.jsonl")]
    env = dict({k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(workdir), env=env, timeout=900)
    assert proc.returncode == 0, explain(proc)
    return proc


def _iterations(workdir):
    return [x for x in map(json.loads, open(os.path.join(str(workdir), "metrics.jsonl"))) if "loss" in x]


MOE_BIASES = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
              "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
              "--lr", "1e-3", "--log-interval", "1", "--num-experts", "2", "--init-layout-invariant",
              "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "3"]


def test_moe_with_linear_biases_trains_like_the_single_process_at_tp2(tmp_path):
    """The engine's MoE with linear biases (no --disable-bias-linear): one process (experts at expert tensor- and
    model-parallel size 1, megatron-core's in-place bias add) against TP2 + sequence parallel + whole experts per
    rank (the layout `rapidformer` picks): losses and gradient norms within 1e-5, so every expert bias gradient is
    counted once. The 2-process run prints each known per-rank message at most once."""
    _engine(tmp_path / "one", 1, *MOE_BIASES)
    two = _engine(tmp_path / "tp2", 2, *MOE_BIASES, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                  "--expert-tensor-parallel-size", "1")
    one_it, two_it = _iterations(tmp_path / "one"), _iterations(tmp_path / "tp2")
    assert len(one_it) == len(two_it) == 3
    for a, b in zip(one_it, two_it):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5, (a, b)
    _said_once(two.stdout + two.stderr)


# ---- 2. configuration errors in the workers: one line, exit 2 -------------------------------------------------------
@pytest.mark.parametrize("nproc,extra", [(1, ["--cpu-offload"]), (2, ["--cpu-offload", "--zero-1-memory-optimization"])])
def test_worker_configuration_error_is_one_line_and_exit_2(gpt_corpus, nproc, extra):
    """A ConfigError raised inside PreTrainer.train() (the Megatron model's full configuration is validated once
    GPTModel() asks for it, after the process groups started) reaches the user as one `rapidformer: error:` line
    and exit status 2, with 1 worker (in-process) and with 2 (torchrun, which itself would exit 1). --cpu-offload
    gets the same answer with or without a ZeRO flag on a machine without a GPU."""
    proc = rapidformer(*_sample_flags(gpt_corpus, *extra, "--nproc-per-node", str(nproc)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, explain(proc)
    errors = [x for x in out.splitlines() if x.startswith("rapidformer: error:")]
    assert errors == ["rapidformer: error: --cpu-offload moves the optimizer state from GPU memory to host memory; "
                      "this machine has no GPU, so everything already lives on the CPU: drop --cpu-offload"], out
    assert out.count("this machine has no GPU") == 1 and "ChildFailedError" not in out
    _said_once(out)


def test_usage_error_status_reaches_the_launcher(tmp_path, monkeypatch):
    """status.py in one process: a worker with the launcher's status directory writes its message and exits 0
    (torchrun stays quiet); the launcher reads the lowest rank's message; without a directory, rank 0 prints."""
    from megatron_patch.cli import status

    monkeypatch.setenv(status.ENV, str(tmp_path))
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        assert status.report_usage_error(ValueError(f"bad flag (rank {rank})")) == 0
    assert status.first_usage_error(str(tmp_path)) == "bad flag (rank 0)"
    (tmp_path / "empty").mkdir()
    assert status.first_usage_error(str(tmp_path / "empty")) is None  # the workers met no usage error
    monkeypatch.delenv(status.ENV)
    assert status.report_usage_error(ValueError("x")) == 2


# ---- 3. refusals in words ----------------------------------------------------------------------------------------------
def test_onnx_runtime_on_a_megatron_model_is_refused_as_a_hugging_face_switch():
    from megatron_patch.config.rapidformer_flags import parse_args
    from megatron_patch.config import ConfigError
    from megatron_patch.templates.pretrain_megatron import engine_config

    args = parse_args(["--user-script", GPT_SAMPLE, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
                       "4", "--train-iters", "2", "--micro-batch-size", "2", "--onnx-runtime-training"])
    with pytest.raises(ConfigError, match="ORTModule trains Hugging Face/PyTorch models") as e:
        engine_config(args)
    assert "ZeRO" not in str(e.value) and "--torch-compile" in str(e.value)


def test_cpu_offload_answer_does_not_depend_on_the_zero_flag(monkeypatch):
    from megatron_patch.config import ConfigError, parse_args

    base = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    monkeypatch.setattr("megatron_patch.config.rule._has_gpu", lambda: False)
    for extra in ([], ["--zero-1-memory-optimization"], ["--zero-2-memory-optimization"]):
        with pytest.raises(ConfigError, match="this machine has no GPU, so everything already lives on the CPU: "
                                              "drop --cpu-offload"):
            parse_args(base + ["--cpu-offload", *extra]).validate(2)
    monkeypatch.setattr("megatron_patch.config.rule._has_gpu", lambda: True)  # a GPU: ZeRO is what it needs
    with pytest.raises(ConfigError, match="needs ZeRO: add --zero-1-memory-optimization"):
        parse_args(base + ["--cpu-offload"]).validate(1)
    assert parse_args(base + ["--cpu-offload", "--zero-1-memory-optimization"]).validate(1).cpu_offload


def test_engine_moe_bias_limits_in_one_sentence_each():
    """The engine's MoE accepts the default linear biases where megatron-core can train them (whole experts per
    rank) and names the fix elsewhere."""
    from megatron_patch.config import ConfigError, parse_args

    base = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-experts", "4"]
    assert parse_args(base).validate(1).num_experts == 4
    assert parse_args(base + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                              "--expert-tensor-parallel-size", "1"]).validate(2).expert_data_parallel_size == 2
    with pytest.raises(ConfigError, match="supports expert biases only at --expert-tensor-parallel-size 1 .it is 2"):
        parse_args(base + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]).validate(2)
    with pytest.raises(ConfigError, match="--moe-grouped-gemm computes the experts without biases"):
        parse_args(base + ["--moe-grouped-gemm"]).validate(1)


def test_blackbox_pretraining_refuses_before_any_worker_starts():
    """--task pretraining trains a Hugging Face model: --num-experts is refused in words, and the run's settings
    are validated by the front end (the same check PreTrainer.train() makes first in every worker)."""
    from megatron_patch.config.rapidformer_flags import UsageError, parse_args
    from megatron_patch.templates.rules import check

    base = ["--task", "pretraining", "--pretrained-model-name-or-path", "m", "--data-path", "d", "--tokenizer-type",
            "BertWordPieceLowerCase", "--vocab-file", "v", "--train-iters", "5", "--save", "/tmp/unused_rf_save"]
    with pytest.raises(UsageError, match="--num-experts 4: --task pretraining trains the Hugging Face model"):
        check(parse_args(base + ["--num-experts", "4"]), 1)
    with pytest.raises(UsageError, match="--seq-length 600 exceeds --max-position-embeddings 512"):
        check(parse_args(base + ["--seq-length", "600", "--max-position-embeddings", "512"]), 1)
    # the acceleration switches (config/flags.py: Flag.switch) wait for the model: ZeRO-3 is a Hugging Face
    # model's, which the engine's own checks would refuse
    from megatron_patch.templates.engine_config import engine_config

    args = parse_args(base + ["--zero-3-memory-optimization", "--mixed-precision", "--checkpoint-activations"])
    early = engine_config(args, accelerations=False)
    assert (early.zero_stage, early.fp16, early.checkpoint_activations) == (0, False, False)


# ---- 5. known messages once ----------------------------------------------------------------------------------------------
def test_transformers_load_report_is_printed_by_rank_0_only(tmp_path):
    """from_pretrained's LOAD REPORT (a BERT masked-LM directory loaded as BertForPreTraining: the next-sentence
    head is new) on rank 0, not on rank 1; an unknown warning still shows on every rank."""
    import transformers

    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16)
    transformers.BertForMaskedLM(config).save_pretrained(str(tmp_path / "bert"))
    code = textwrap.dedent(f"""
        import warnings
        from megatron_patch.compat import quiet_known_noise
        quiet_known_noise()
        import transformers
        transformers.BertForPreTraining.from_pretrained({str(tmp_path / "bert")!r})
        warnings.warn("an unknown warning")
    """)
    procs = {}
    for rank in ("0", "1"):  # side by side, as two workers start
        env = dict({k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}, RANK=rank, PYTHONPATH=ROOT)
        procs[rank] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, env=env)
    said = {}
    for rank, proc in procs.items():
        said[rank] = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, said[rank][-3000:]
    assert "LOAD REPORT" in said["0"] and "LOAD REPORT" not in said["1"]
    assert all("an unknown warning" in s for s in said.values())


# ---- 4. --mixed-precision with ONNX Runtime --------------------------------------------------------------------------------
def test_precision_line_says_where_fp16_runs_under_onnx_runtime():
    from megatron_patch.accelerations.precision import Precision

    fp16 = Precision(torch.float16, torch.device("cpu"))
    text = fp16.describe(onnx_runtime=True)
    assert "fp16 autocast recorded into ONNX Runtime's graph" in text and "about 1.7x slower" in text, text
    assert "about 10x slower" in fp16.describe() and "ONNX" not in fp16.describe()
    assert "bf16 autocast recorded into ONNX Runtime's graph" in Precision(torch.bfloat16, torch.device("cpu")).describe(
        onnx_runtime=True)


ORT_FP16 = textwrap.dedent("""
    import sys, torch, transformers
    from megatron_patch.accelerations import accelerate
    from megatron_patch.config.rapidformer_flags import parse_args
    flags = ["--task", "sequence_classification", "--pretrained-model-name-or-path", "m", "--data-path", "d",
             "--onnx-runtime-training", "--weight-decay", "0", "--lr", "1e-3"] + sys.argv[1:]
    args = parse_args(flags)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    acc = accelerate(transformers.BertForSequenceClassification(config).train(), args, torch.device("cpu"))
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    with acc.precision.autocast():
        out = acc.model(input_ids=ids, labels=torch.tensor([0, 1, 0, 1]))
    acc.precision.backward(out.loss)
    graph = acc.model._torch_module._execution_manager(True)._onnx_models.optimized_model.graph
    to_fp16 = sum(1 for n in graph.node if n.op_type == "Cast" for a in n.attribute if a.name == "to" and a.i == 10)
    print("RESULT", out.logits.dtype, to_fp16, acc.applied[-1])
""")


@pytest.mark.slow  # the first use of ONNX Runtime compiles its C++ extensions (minutes); then ~30 s
def test_mixed_precision_runs_in_fp16_inside_the_onnx_runtime_graph():
    """--mixed-precision with --onnx-runtime-training (accelerate(), as the templates call it): the exported graph
    casts to fp16 and the logits come back in fp16; without it, no fp16 cast and fp32 logits."""
    from megatron_patch.accelerations import ort_available

    if not ort_available():
        pytest.skip("ONNX Runtime training is an optional extra: pip install onnxruntime-training-cpu==1.19.2")
    results = {}
    for extra in ([], ["--mixed-precision"]):
        proc = subprocess.run([sys.executable, "-c", ORT_FP16, *extra], capture_output=True, text=True, cwd=ROOT,
                              timeout=1800)
        assert proc.returncode == 0, explain(proc)
        results[bool(extra)] = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    assert results[False].startswith("RESULT torch.float32 0 precision: fp32"), results
    assert results[True].startswith("RESULT torch.float16 "), results
    assert int(results[True].split()[2]) > 0 and "recorded into ONNX Runtime's graph" in results[True], results
