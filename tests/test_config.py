"""Every validate() rejection, and presets/flags parsing."""
import re

import pytest

from megatron_patch.config import ConfigError, parse_args

BASE = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]


def cfg(*extra):
    return parse_args(BASE + list(extra))


@pytest.mark.parametrize(
    "extra,world,match",
    [
        (["--tensor-model-parallel-size", "3"], 3, "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
        (["--pipeline-model-parallel-size", "3"], 3, "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"),
        (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"], 2,
         "not divisible by --pipeline-model-parallel-size 2 x --num-layers-per-virtual-pipeline-stage 3"),
        (["--num-layers-per-virtual-pipeline-stage", "1"], 1, "needs --pipeline-model-parallel-size > 1"),
        (["--micro-batch-size", "3", "--global-batch-size", "8"], 2, "--global-batch-size 8 is not divisible by --micro-batch-size 3 x data-parallel size 2"),
        (["--zero-3-memory-optimization", "--tensor-model-parallel-size", "2"], 2, "cannot be combined with tensor or pipeline"),
        (["--zero-3-memory-optimization", "--pipeline-model-parallel-size", "2"], 2, "cannot be combined with tensor or pipeline"),
        (["--zero-1-memory-optimization", "--zero-2-memory-optimization"], 2, "choose one ZeRO stage"),
        (["--zero-2-memory-optimization", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
          "--num-layers-per-virtual-pipeline-stage", "1"], 2, "not supported with virtual pipeline stages"),
        (["--zero-2-memory-optimization", "--fp16"], 2, "fp16 loss scaling is not supported"),
        (["--sequence-parallel"], 1, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
        (["--fp16", "--bf16"], 1, "mutually exclusive"),
        (["--mixed-precision", "--bf16"], 1, "--mixed-precision means fp16"),
        (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 6, "world size 6 is not divisible"),
        (["--num-query-groups", "3"], 1, "not a multiple of --num-query-groups 3"),
        (["--num-query-groups", "2", "--tensor-model-parallel-size", "4"], 4, "--num-query-groups 2 is not divisible"),
        (["--cpu-offload"], 1, "this machine has no GPU"),
        (["--cpu-offload", "--zero-1-memory-optimization"], 1, "this machine has no GPU"),
        (["--optimizers", "apex_lamb", "--zero-1-memory-optimization"], 2, "apex_lamb needs whole parameters"),
        (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"], 1, "not both"),
        (["--train-iters", "10", "--lr-warmup-iters", "10"], 1, "warmup"),
        (["--save-interval", "5"], 1, "--save-interval needs --save"),
        (["--seq-length", "256", "--max-position-embeddings", "128"], 1, "exceeds --max-position-embeddings"),
        (["--data-iterator", "dynamic-shape"], 1, "packed"),
    ],
)
def test_rejections(extra, world, match, no_gpu):
    with pytest.raises(ConfigError, match=re.escape(match)):
        cfg(*extra).validate(world)


@pytest.fixture
def no_gpu(monkeypatch):
    """The rejections above describe a machine without a GPU, whatever machine runs the test."""
    monkeypatch.setattr("megatron_patch.config.rule._has_gpu", lambda: False)


@pytest.fixture
def gpu_host(monkeypatch):
    """validate() as it runs on a machine with a GPU (probed by megatron_patch.config.rule._has_gpu)."""
    monkeypatch.setattr("megatron_patch.config.rule._has_gpu", lambda: True)


def test_gpu_host_accepts_gpu_only_switches(gpu_host):
    # --sequence-parallel is refused for the other reason only: it needs tensor parallelism.
    with pytest.raises(ConfigError, match=re.escape("--sequence-parallel needs --tensor-model-parallel-size > 1")):
        cfg("--sequence-parallel").validate(1)
    assert cfg("--sequence-parallel", "--tensor-model-parallel-size", "2").validate(2).sequence_parallel
    # --cpu-offload is accepted with ZeRO, and still refused without it.
    assert cfg("--cpu-offload", "--zero-1-memory-optimization").validate(1).cpu_offload
    with pytest.raises(ConfigError, match="--cpu-offload keeps the sharded optimizer state"):
        cfg("--cpu-offload").validate(1)


def test_gpu_probe_is_the_one_validate_consults(no_gpu):
    # The same flags as above, on a machine without a GPU: refused because of the machine.
    # --sequence-parallel runs on the CPU backend (its backward allocations are redirected too).
    assert cfg("--sequence-parallel", "--tensor-model-parallel-size", "2").validate(2).sequence_parallel
    with pytest.raises(ConfigError, match="this machine has no GPU"):
        cfg("--cpu-offload", "--zero-1-memory-optimization").validate(1)


def test_no_data_is_rejected():
    with pytest.raises(ConfigError, match="no training data"):
        parse_args(["--num-layers", "2"]).validate(1)
    with pytest.raises(ConfigError, match="needs --tokenizer-type"):
        parse_args(["--data-path", "x"]).validate(1)


def test_derived_values_and_aliases():
    c = cfg("--micro-batch-size", "2", "--global-batch-size", "32", "--tensor-model-parallel-size", "2",
            "--mixed-precision", "--checkpoint-activations").validate(8)
    assert (c.data_parallel_size, c.num_microbatches) == (4, 4)
    assert c.fp16 and c.recompute_granularity == "full"


def test_warmup_fraction_resolves_against_the_final_iterations():
    # What the launchers pass by default: the warmup follows whatever --train-iters / --lr-decay-iters end up as.
    assert cfg("--lr-warmup-fraction", "0.0667", "--train-iters", "300").validate(1).warmup_iters == 20
    assert cfg("--lr-warmup-fraction", "0.0667", "--train-iters", "6").validate(1).warmup_iters == 0
    c = cfg("--lr-warmup-fraction", "0.1", "--train-iters", "300", "--lr-decay-iters", "150").validate(1)
    assert (c.warmup_iters, c.decay_iters) == (15, 150)
    with pytest.raises(ConfigError, match=re.escape("--lr-warmup-fraction 1.5 must be in [0, 1)")):
        cfg("--lr-warmup-fraction", "1.5").validate(1)


def test_validate_twice_changes_nothing():
    # The entry point validates before launch and initialize() again in each worker.
    c = cfg("--mixed-precision", "--checkpoint-activations", "--micro-batch-size", "2", "--lr-warmup-fraction", "0.1")
    once = dict(vars(c.validate(2)))
    assert vars(c.validate(2)) == once


def test_bad_flags_are_configuration_errors():
    with pytest.raises(ConfigError, match="unrecognized arguments: --no-such-flag"):
        parse_args(["--mock-data", "--no-such-flag"])
    with pytest.raises(ConfigError, match="--train-iters: invalid int value"):
        parse_args(["--train-iters", "ten"])


def test_presets_and_overrides():
    c = parse_args(["--model-family", "llama", "--model-size", "1.3b", "--mock-data", "--num-layers", "2"])
    assert (c.num_layers, c.hidden_size, c.ffn_hidden_size, c.num_attention_heads) == (2, 2048, 5504, 16)
    assert c.swiglu and c.normalization == "RMSNorm" and c.position_embedding_type == "rope"
    assert c.untie_embeddings_and_output_weights and c.disable_bias_linear
    with pytest.raises(ConfigError, match="--model-size '9t'"):
        parse_args(["--model-family", "gpt", "--model-size", "9t"])


def test_entry_point_reports_config_errors(tmp_path):
    import subprocess
    import sys
    from engine_utils import ROOT

    proc = subprocess.run([sys.executable, f"{ROOT}/pretrain_megatron_gpt.py", *BASE, "--tensor-model-parallel-size", "3"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "configuration error: --num-attention-heads 4" in proc.stderr


@pytest.mark.parametrize("argv,match", [
    (["--compile-mode", "reduce-overhead"], "--compile-mode reduce-overhead takes effect only with --compile"),
    (["--compile", "--compile-mode", "fast"], "invalid choice"),
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 applies to bf16 training: add --bf16"),
    (["--grad-reduce-in-bf16", "--bf16", "--zero-2-memory-optimization"], "ZeRO-2 (Megatron-FSDP) keeps its sharded"),
    (["--gradient-accumulation-fusion", "--zero-2-memory-optimization"], "ZeRO-2 (Megatron-FSDP) shards its gradients"),
])
def test_performance_flag_rejections(argv, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        cfg(*argv).validate(2)


def test_performance_flags_parse():
    c = cfg("--compile", "--compile-mode", "reduce-overhead", "--bf16", "--grad-reduce-in-bf16").validate(1)
    assert (c.compile, c.compile_mode, c.grad_reduce_in_bf16) == (True, "reduce-overhead", True)
    assert cfg().validate(1).compile_mode == "default" and not cfg().validate(1).grad_reduce_in_bf16
