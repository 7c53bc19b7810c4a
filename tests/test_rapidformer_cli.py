"""The `rapidformer` front end: the parameter guide's flags and defaults, the how-to's commands, and the
front end's own rules (in-process: parsing and checking start no worker)."""
from __future__ import annotations

import shlex

import pytest

from megatron_patch.config.rapidformer_flags import UsageError, parse_args
from megatron_patch.templates.rules import check

# The how-to's commands, with its hub names replaced by local paths (what the README runs).
HOWTO_FINETUNE = """--task sequence_classification --pretrained-model-name-or-path MODEL --data-path DATA --data-name mrpc
 --epochs 3 --micro-batch-size 16 --global-batch-size 64 --lr 2e-5 --lr-decay-style linear --lr-warmup-iters 100
 --weight-decay 1e-2 --clip-grad 1.0 --seed 42 --mixed-precision --zero-1-memory-optimization"""
HOWTO_FINETUNER = """--user-script {script} --task sequence_classification --pretrained-model-name-or-path MODEL
 --data-path DATA --data-name mrpc --epochs 3 --micro-batch-size 16 --global-batch-size 16 --lr 2e-5
 --lr-decay-style linear --lr-warmup-iters 100 --weight-decay 1e-2 --clip-grad 1.0 --mixed-precision
 --zero-3-memory-optimization"""


def parsed(cmd: str, world: int = 1):
    return check(parse_args(shlex.split(cmd)), world_size=world)


def test_defaults_are_the_parameter_guides():
    a = parse_args(["--task", "masked_lm"])
    assert (a.lr_decay_style, a.weight_decay, a.clip_grad, a.log_interval, a.split, a.data_impl, a.optimizers) == \
        ("linear", 0.01, 1.0, 100, "969,30,1", "mmap", "apex_adam")
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size) == (1, 1)


def test_names_the_samples_read():
    a = parse_args(["--task", "casual_lm", "--data-path", "d", "--dataset-name", "cfg",
                    "--pretrained-model-name-or-path", "m", "--compile"])
    assert (a.task, a.dataset_path, a.dataset_name, a.data_name, a.load, a.torch_compile) == \
        ("causal_lm", "d", "cfg", "cfg", "m", True)
    assert parse_args(["--task", "masked_lm", "--load", "x", "--pretrained-model-name-or-path", "m"]).load == "x"


def test_howto_finetune_command_runs_with_defaults_named(tmp_path):
    a = parsed(HOWTO_FINETUNE, world=4)
    # epoch-based: no accumulation; 64 != 16 x 4 is not an error
    assert (a.grad_accumulation, a.global_batch_size) == (1, 64)
    assert a.save and any("--save not given" in n for n in a.notes)
    b = parsed(HOWTO_FINETUNE, world=2)  # 64 != 16 x 2: one note says what is used
    assert b.global_batch_size == 32 and any("--global-batch-size 64 is not used" in n for n in b.notes)


def test_iteration_based_runs_accumulate_gradients():
    a = parsed("--task masked_lm --pretrained-model-name-or-path m --data-path d --train-iters 10 "
               "--micro-batch-size 4 --global-batch-size 32", world=2)
    assert a.grad_accumulation == 4 and a.epochs is None
    with pytest.raises(UsageError, match="not a multiple of --micro-batch-size 4 x 2 workers"):
        parsed("--task masked_lm --pretrained-model-name-or-path m --data-path d --train-iters 10 "
               "--micro-batch-size 4 --global-batch-size 12", world=2)


def test_cuda_graph_compile_mode_pads_batches_to_a_multiple():
    a = parsed("--task masked_lm --pretrained-model-name-or-path m --data-path d --torch-compile-mode reduce-overhead")
    assert a.torch_compile and a.pad_to_multiple_of == 64
    assert any("turns on --torch-compile" in n for n in a.notes) and any("multiple of 64" in n for n in a.notes)
    b = parsed("--task masked_lm --pretrained-model-name-or-path m --data-path d --torch-compile-mode default")
    assert b.torch_compile and b.pad_to_multiple_of is None  # no graphs: exact padding stays
    c = parsed("--task masked_lm --pretrained-model-name-or-path m --data-path d --torch-compile-mode max-autotune "
               "--pad-to-multiple-of 8")
    assert c.pad_to_multiple_of == 8


def test_compile_flags_take_the_engine_spelling_too():
    # the engine spells them --compile / --compile-mode; each front end accepts the other's spelling
    a = parsed("--task masked_lm --pretrained-model-name-or-path m --data-path d --compile-mode reduce-overhead")
    assert a.torch_compile and a.torch_compile_mode == "reduce-overhead"
    from megatron_patch.config import parse_args as engine_args
    c = engine_args(["--mock-data", "--torch-compile", "--torch-compile-mode", "reduce-overhead"])
    assert c.compile and c.compile_mode == "reduce-overhead"


def test_missing_schedule_flags_get_named_defaults():
    a = parsed("--task masked_lm --pretrained-model-name-or-path m --data-path d")
    assert a.epochs == 3 and a.lr == 5e-5 and a.micro_batch_size == 8
    assert sum(("not given" in n) for n in a.notes) >= 3


@pytest.mark.parametrize("extra, words", [
    ("--tensor-model-parallel-size 2", "tensor and pipeline parallelism apply to Megatron models"),
    ("--pipeline-model-parallel-size 2", "Drop --pipeline-model-parallel-size"),
    ("--data-iterator dynamic-shape", "belongs to pretraining"),
    ("--num-experts 4", "--num-experts 4"),
    ("--lr-warmup-fraction 0.1 --lr-warmup-iters 5", "use one"),
    ("--mixed-precision --bf16", "--bf16"),
    ("--zero-1-memory-optimization --fsdp-memory-optimization", "--fsdp-memory-optimization"),
    ("--oss-memory-optimization --cpu-offload", "ZeRO"),
    ("--torch-compile-mode reduce-overhead --zero-2-memory-optimization",
     "cannot run with --zero-2-memory-optimization: a replayed graph"),
    ("--pad-to-multiple-of 0", "--pad-to-multiple-of 0"),
])
def test_impossible_combinations_are_refused_in_words(extra, words):
    with pytest.raises(UsageError, match=words.replace("-", r"\-").replace(".", r"\.")):
        parsed(f"--task sequence_classification --pretrained-model-name-or-path m --data-path d {extra}")


def test_what_a_run_needs_is_named():
    with pytest.raises(UsageError, match="give --task"):
        parsed("--epochs 1")
    with pytest.raises(UsageError, match="--pretrained-model-name-or-path"):
        parsed("--task masked_lm --data-path d")
    with pytest.raises(UsageError, match="--data-path"):
        parsed("--task masked_lm --pretrained-model-name-or-path m")
    with pytest.raises(UsageError, match="no such file"):
        parsed("--user-script /nonexistent/script.py")
    with pytest.raises(SystemExit):
        parse_args(["--task", "masked_lm", "--no-such-flag"])


def test_rendezvous_ports_come_from_outside_the_ephemeral_range():
    """The launchers' MASTER_PORT (megatron_patch.ports.free_port): a port the OS hands out to outgoing connections
    could be taken by another job's gloo connection before the rendezvous listens on it (seen as EADDRINUSE with two
    test workers), so it is picked outside that range, and free now."""
    import socket

    from megatron_patch.ports import _ephemeral_range, free_port

    lo, hi = _ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert not lo <= port <= hi and 1024 <= port < 65536, (port, lo, hi)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
