"""The engine's one typed configuration (issue 28 part 1): frozen sections by concern, enums for ZeRO and precision,
a pure resolve(), the rules as one table of named checks, file-system checks apart. (The rules' messages are
tested where their features are: test_config.py, test_moe.py, ...)"""
import dataclasses
import json

import pytest

from megatron_patch.config import Config, ConfigError, parse_args
from megatron_patch.config.checks import CHECKS, run_checks
from megatron_patch.config.config import HOME, SECTIONS, Precision
from megatron_patch.config.validate import check_paths, resolve


def test_each_setting_lives_in_one_frozen_section_and_reads_flat():
    cfg = Config(num_layers=4, lr=3e-4, tensor_model_parallel_size=2, micro_batch_size=2, save="s")
    assert (cfg.model.num_layers, cfg.optimizer.lr, cfg.parallel.tensor_model_parallel_size) == (4, 3e-4, 2)
    assert (cfg.num_layers, cfg.lr, cfg.tensor_model_parallel_size, cfg.save) == (4, 3e-4, 2, "s")
    assert set(HOME.values()) == set(SECTIONS)
    assert len(HOME) == sum(len(dataclasses.fields(c)) for c in SECTIONS.values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.num_layers = 8
    with pytest.raises(TypeError, match="no setting num_layer"):
        Config(num_layer=4)
    with pytest.raises(AttributeError):
        cfg.num_layer
    changed = cfg.replace(num_layers=8, bf16=True)
    assert (changed.num_layers, changed.bf16, cfg.num_layers, cfg.bf16) == (8, True, 4, False)
    assert changed.lr == 3e-4 and changed.save == "s"  # the rest carried over


def test_zero_and_precision_are_enums_read_by_the_flags_names():
    assert Config().zero_stage == 0 and Config().precision is Precision.FP32
    for stage in (1, 2, 3):
        cfg = parse_args(["--mock-data", f"--zero-{stage}-memory-optimization"])
        assert cfg.zero_stage == stage
        assert [cfg.zero_1_memory_optimization, cfg.zero_2_memory_optimization, cfg.zero_3_memory_optimization] == \
            [stage == n for n in (1, 2, 3)]
    assert parse_args(["--bf16"]).precision is Precision.BF16 and parse_args(["--bf16"]).bf16
    assert parse_args(["--fp16"]).precision is Precision.FP16
    mixed = parse_args(["--mixed-precision"])  # Rapidformer's --mixed-precision is fp16
    assert mixed.precision is Precision.FP16 and mixed.fp16 and not mixed.bf16
    assert Config(precision="bf16").bf16 and Config(zero_stage=2).zero_2_memory_optimization
    with pytest.raises(ConfigError, match="choose one ZeRO stage"):
        parse_args(["--zero-1-memory-optimization", "--zero-2-memory-optimization"])
    with pytest.raises(ConfigError, match="mutually exclusive"):
        parse_args(["--fp16", "--bf16"])


def test_a_stored_configuration_of_either_form_loads():
    """Checkpoints before issue 28 stored the flags' booleans; today's store the enums. Both give the same Config,
    and what is stored is JSON."""
    old = {"num_layers": 3, "zero_2_memory_optimization": True, "zero_1_memory_optimization": False, "bf16": True,
           "fp16": False, "mixed_precision": False, "an_old_setting": 1}
    cfg = Config.from_flat(old)
    assert (cfg.num_layers, cfg.zero_stage, cfg.precision) == (3, 2, Precision.BF16)
    stored = json.loads(json.dumps(cfg.to_flat()))
    assert stored["zero_stage"] == 2 and stored["precision"] == "bf16" and stored["num_layers"] == 3
    assert Config.from_flat(stored) == cfg


def test_resolve_is_pure_and_fills_the_dependent_settings(tmp_path):
    save = tmp_path / "not" / "yet"
    cfg = parse_args(["--mock-data", "--micro-batch-size", "2", "--checkpoint-activations", "--seq-length", "64",
                      "--tensor-model-parallel-size", "2", "--save", str(save)])
    before = cfg.to_flat()
    r = resolve(cfg, 8)
    assert cfg.to_flat() == before  # the input is unchanged
    assert not save.exists()  # no I/O: --save is created by check_paths, at the entry point
    assert (r.world_size, r.data_parallel_size, r.global_batch_size, r.num_microbatches) == (8, 4, 8, 1)
    assert (r.max_position_embeddings, r.recompute_granularity, r.vocab_size) == (64, "full", 1024)
    assert resolve(r, 8) == r  # resolving twice changes nothing
    check_paths(r)
    assert save.is_dir()
    assert cfg.validate(8) == r.replace(checked=True)  # the entry point's call: resolve, the rules, the file system


def test_the_rules_are_one_table_of_named_checks_by_concern():
    names = [c.name for c in CHECKS]
    assert len(names) == len(set(names)) and len(names) >= 30
    assert {c.concern for c in CHECKS} >= {"layout", "moe", "batch", "memory", "precision", "fusion", "schedule",
                                            "model", "data", "checkpoint"}
    ok = resolve(parse_args(["--mock-data"]), 1)
    run_checks(ok)  # a sound configuration passes every rule
    bad = resolve(parse_args(["--mock-data", "--sequence-parallel", "--train-iters", "0"]), 1)
    with pytest.raises(ConfigError, match="--sequence-parallel needs"):  # the table's order: memory before schedule
        run_checks(bad)
    with pytest.raises(ConfigError, match="--train-iters must be at least 1"):
        run_checks(bad, concerns=("schedule",))


def test_a_validated_configuration_is_checked_once(monkeypatch):
    """validate() marks the Config it returns as checked for its world size, so initialize() does not run the rules
    again in the same process; any change, or a configuration read back from a checkpoint, is unchecked."""
    import megatron_patch.config.validate as validate_module

    cfg = parse_args(["--mock-data"]).validate(1)
    assert cfg.checked and not parse_args(["--mock-data"]).checked
    assert not cfg.replace(lr=1e-3).checked
    assert not Config.from_flat(json.loads(json.dumps(cfg.to_flat()))).checked and "checked" not in cfg.to_flat()
    runs = []
    monkeypatch.setattr(validate_module, "run_checks", lambda c: runs.append(c.world_size))
    from megatron_patch.parallel import destroy, initialize
    from megatron_patch.ports import free_port

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)  # a world of one, undone after the test
    try:
        assert initialize(cfg).checked and runs == []  # the entry point's validate() is not repeated
    finally:
        destroy()
    try:
        initialize(cfg.replace(lr=1e-3))
        assert runs == [1]
    finally:
        destroy()


def test_a_model_only_run_is_checked_by_the_model_rules_only():
    """Conversion builds a model and trains nothing: its Config needs no data or schedule, but a layout that cannot
    split the model is refused all the same."""
    from megatron_patch.config.validate import validate_model

    untrained = Config(num_layers=2, hidden_size=64, num_attention_heads=4, train_iters=0)  # no data, no steps
    assert validate_model(untrained, 2).checked
    with pytest.raises(ConfigError, match="--train-iters must be at least 1"):
        untrained.validate(1)  # what a training run is refused for
    with pytest.raises(ConfigError, match="no training data"):
        untrained.replace(train_iters=1).validate(1)
    with pytest.raises(ConfigError, match="--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"):
        validate_model(untrained.replace(tensor_model_parallel_size=3), 3)
