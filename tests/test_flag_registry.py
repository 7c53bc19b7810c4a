"""The one flag registry (megatron_patch/config/flags.py) and the parsers generated from it: each flag declared once,
each entry point's parser takes exactly its flags with the defaults it had, --help lists them, and a flag given to
the wrong entry point is refused in words naming the one that takes it. No process is started (about 1 s)."""
from __future__ import annotations

import re

import pytest

from megatron_patch.config import Config, ConfigError
from megatron_patch.config import arguments, rapidformer_flags
from megatron_patch.config.flags import (ALL, BY_NAME, ENGINE, ENTRY_NAMES, FLAGS, RAPIDFORMER, declarations, for_entry,
                                         front_to_engine)

# `rapidformer`'s namespace when no flag is given, as its hand-written parser made it before the registry
RAPIDFORMER_DEFAULTS = {
    'task': None, 'user_script': None, 'nproc_per_node': None, 'max_restarts': None, 'data_path': None, 'data_name': None, 'data_dir': None,
    'text_columns': None, 'label_column': None, 'micro_batch_size': None, 'global_batch_size': None,
    'tokenizer_type': None, 'vocab_file': None, 'merge_file': None, 'split': '969,30,1', 'data_impl': 'mmap',
    'data_iterator': None, 'num_workers': 0, 'pad_to_multiple_of': None, 'mask_prob': 0.15, 'short_seq_prob': 0.1,
    'mmap_warmup': False, 'eod_mask_loss': False, 'reset_position_ids': False, 'reset_attention_mask': False,
    'data_cache_path': None, 'pretrained_model_name_or_path': None, 'num_layers': None, 'hidden_size': None,
    'num_attention_heads': None, 'max_position_embeddings': None, 'seq_length': None, 'num_experts': None,
    'ffn_hidden_size': None, 'hidden_dropout': None, 'attention_dropout': None, 'init_method_std': None,
    'make_vocab_size_divisible_by': None, 'save': None, 'load': None, 'lr': None, 'min_lr': 0.0,
    'lr_decay_style': 'linear', 'lr_decay_iters': None, 'lr_warmup_fraction': None, 'lr_warmup_iters': None,
    'weight_decay': 0.01, 'clip_grad': 1.0, 'adam_beta1': 0.9, 'adam_beta2': 0.999, 'adam_eps': 1e-08,
    'train_iters': None, 'epochs': None, 'seed': 1234, 'log_interval': 100, 'eval_interval': 1000, 'eval_iters': 10,
    'save_interval': None, 'override_opt_param_scheduler': False, 'use_checkpoint_opt_param_scheduler': False,
    'eval_at_start': False, 'metrics_file': None, 'tensorboard_dir': None, 'mixed_precision': False, 'bf16': False,
    'zero_1_memory_optimization': False, 'zero_2_memory_optimization': False, 'zero_3_memory_optimization': False,
    'oss_memory_optimization': False, 'oss_sdp_memory_optimization': False, 'fsdp_memory_optimization': False,
    'cpu_offload': False, 'checkpoint_activations': False, 'optimizers': 'apex_adam', 'torch_compile': False,
    'torch_compile_mode': None, 'onnx_runtime_training': False, 'padding_free': False, 'tensor_model_parallel_size': 1,
    'pipeline_model_parallel_size': 1, 'num_layers_per_virtual_pipeline_stage': None,
    # issue 30: LoRA through peft (off by default)
    'lora_rank': 0, 'lora_alpha': 32.0, 'lora_dropout': 0.0,
    'lora_target': ['linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2'],
}


def parser(entry: str):
    """The parser as each entry point builds it (through its own module, not the generator directly)."""
    return rapidformer_flags.build_parser() if entry == RAPIDFORMER else arguments.build_parser(entry)


def option_strings(p) -> set:
    return {o for a in p._actions for o in a.option_strings} - {"-h", "--help"}


def test_each_flag_is_declared_once():
    names = [n for f in FLAGS for n in f.names]
    assert len(names) == len(set(names)) == len(BY_NAME)
    for entry in ENTRY_NAMES:  # one record per dest and entry point: no flag declared twice under two names
        dests = [f.dest_for(entry) for f in for_entry(entry)]
        assert len(dests) == len(set(dests)), entry
    assert all(f.entries and f.entries <= ALL and f.help for f in FLAGS)
    count = declarations()
    assert count == {"flags": len(FLAGS), "option_strings": len(names)}
    print(f"flag registry: {count['flags']} flags, {count['option_strings']} option strings")


@pytest.mark.parametrize("entry", ENTRY_NAMES)
def test_each_parser_takes_exactly_its_registry_flags(entry):
    expected = {n for f in for_entry(entry) for n in f.names_for(entry)}
    assert option_strings(parser(entry)) == expected
    assert expected <= set(BY_NAME)


def test_engine_defaults_are_configs_and_flags_not_given_are_left_out():
    cfg = Config()
    for entry in sorted(ENGINE):
        assert vars(parser(entry).parse_args([])) == {}, entry  # argparse.SUPPRESS: presets/Config fill them in
        for f in for_entry(entry):
            assert f.default_for(entry) == getattr(cfg, f.dest), f.names[0]
    assert arguments.parse_args([]) == cfg


def test_rapidformer_defaults_are_what_they_were():
    assert vars(parser(RAPIDFORMER).parse_args([])) == RAPIDFORMER_DEFAULTS
    # a flag both take has the engine's default unless the record says why rapidformer differs
    cfg = Config()
    for f in for_entry(RAPIDFORMER):
        if f.entries & ENGINE and f.front is None:
            assert RAPIDFORMER_DEFAULTS[f.dest] == getattr(cfg, f.dest), f.names[0]


def test_the_front_end_reaches_the_engine_through_the_registry():
    """templates/engine_config.py maps rapidformer's dests to Config fields with this table."""
    table = front_to_engine()
    assert table["torch_compile"] == "compile" and table["torch_compile_mode"] == "compile_mode"
    shared = [f for f in FLAGS if RAPIDFORMER in f.entries and f.entries & ENGINE]
    assert len(table) == len(shared) and all(hasattr(Config(), dest) for dest in table.values())


def _listed(text: str) -> set:
    """The option strings --help lists (its option lines, not the flags that help texts mention)."""
    out = set()
    for line in text.splitlines():
        if line.startswith("  -"):
            invocation = re.split(r"\s{2,}", line.strip())[0]
            out |= {t.rstrip(",") for t in invocation.split() if t.startswith("--")}
    return out


@pytest.mark.parametrize("entry", ENTRY_NAMES)
def test_help_lists_the_entry_points_flags_with_their_help(entry):
    text = parser(entry).format_help()
    squeezed = "".join(text.split())  # argparse wraps lines (also after hyphens)
    expected = {n for f in for_entry(entry) for n in f.names_for(entry)}
    assert _listed(text) == expected | {"--help"}
    for f in for_entry(entry):
        assert "".join(f.help_for(entry).split()) in squeezed, f.names[0]
    for f in FLAGS:
        if entry not in f.entries:
            assert not set(f.names) & _listed(text), f.names


@pytest.mark.parametrize("argv", [["--epochs", "3"], ["--epochs=3"]])
def test_a_rapidformer_flag_on_the_engine_names_rapidformer(argv):
    with pytest.raises(ConfigError, match=re.escape(
            "--epochs is a rapidformer flag (it applies to Hugging Face fine-tuning and pretraining), not one of "
            "pretrain_megatron_gpt.py's; run it with rapidformer")):
        arguments.parse_args(["--mock-data", *argv])


@pytest.mark.parametrize("argv, flag", [(["--bert-no-binary-head"], "--bert-no-binary-head"),
                                        (["--mask-prob=0.3"], "--mask-prob"),
                                        (["--short-seq-prob", "0.2"], "--short-seq-prob")])
def test_a_bert_flag_on_the_gpt_entry_point_names_the_bert_one(argv, flag):
    with pytest.raises(ConfigError) as e:
        arguments.parse_args(["--mock-data", *argv])
    text = str(e.value)
    assert text.startswith(f"{flag} is a pretrain_megatron_bert.py") and "applies to BERT pretraining" in text
    assert ("not one of pretrain_megatron_gpt.py's; run it with pretrain_megatron_bert.py "
            "(pretrain_scripts/run_bert.sh)") in text
    assert arguments.parse_args(["--mock-data", *argv], model="bert").model_family == "bert"  # its own entry takes it


@pytest.mark.parametrize("argv, flag", [(["--swiglu"], "--swiglu"), (["--moe-router-topk=2"], "--moe-router-topk"),
                                        (["--fp16"], "--fp16")])
def test_an_engine_flag_on_rapidformer_names_the_engine_scripts(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        rapidformer_flags.parse_args(["--task", "sequence_classification", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"rapidformer: error: {flag} is a pretrain_megatron_gpt.py / pretrain_megatron_bert.py flag (it "
                   "applies to pretraining on the Megatron engine), not one of rapidformer's; run it with "
                   "pretrain_megatron_gpt.py or pretrain_megatron_bert.py (pretrain_scripts/run_gpt.sh, run_bert.sh)\n")


def test_an_alias_of_another_entry_point_says_how_this_one_spells_the_flag(capsys):
    with pytest.raises(SystemExit):
        rapidformer_flags.parse_args(["--vocab", "v.txt"])
    assert "--vocab is not one of rapidformer's flags: rapidformer spells it --vocab-file" in capsys.readouterr().err
    assert arguments.parse_args(["--mock-data", "--vocab", "v.txt"]).vocab_file == "v.txt"


def test_unknown_flags_stay_argparses_errors(capsys):
    with pytest.raises(ConfigError, match="unrecognized arguments: --no-such-flag"):
        arguments.parse_args(["--mock-data", "--no-such-flag"])
    with pytest.raises(SystemExit) as e:
        rapidformer_flags.parse_args(["--no-such-flag"])
    assert e.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
