"""The package's public API (DESIGN.md's Layout): each name imports from `megatron_patch`, is the object the
templates define, is what `rapidformer` re-exports, and `import megatron_patch` alone stays cheap (lazy names).
Budget: about 5 s on an idle machine (the templates are imported once; one subprocess imports only the package)."""
import importlib
import subprocess
import sys

import pytest

import megatron_patch

PUBLIC = {
    "RapidformerEngine": ("megatron_patch.templates.engine", "RapidformerEngine"),
    "Finetuner": ("megatron_patch.templates.finetuner", "Finetuner"),
    "PreTrainer": ("megatron_patch.templates.pretrainer", "PreTrainer"),
    "get_args": ("megatron_patch.templates.globals", "get_args"),
    "get_logger": ("megatron_patch.templates.globals", "get_logger"),
    "get_timers": ("megatron_patch.templates.globals", "get_timers"),
    "mpu": ("megatron_patch.templates.mpu", None),
    "build_train_valid_test_datasets_for_huggingface": ("megatron_patch.templates.pretraining_data",
                                                        "build_train_valid_test_datasets_for_huggingface"),
}


def test_all_lists_the_design_names():
    assert sorted(megatron_patch.__all__) == sorted(PUBLIC)
    assert set(PUBLIC) <= set(dir(megatron_patch))


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_each_name_is_the_templates_object(name):
    module, attribute = PUBLIC[name]
    expected = importlib.import_module(module)
    if attribute is not None:
        expected = getattr(expected, attribute)
    assert getattr(megatron_patch, name) is expected
    namespace = {}
    exec(f"from megatron_patch import {name}", namespace)
    assert namespace[name] is expected


def test_rapidformer_reexports_the_same_objects():
    import rapidformer

    for name in PUBLIC:
        assert getattr(rapidformer, name) is getattr(megatron_patch, name), name
    assert rapidformer.Pretrainer is megatron_patch.PreTrainer  # the how-to's spelling


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        megatron_patch.Trainer  # noqa: B018
    assert not hasattr(megatron_patch, "finetuner")


def test_import_is_cheap_and_lazy():
    """`import megatron_patch` loads no torch, megatron-core or templates (the names above resolve on use)."""
    code = ("import sys, megatron_patch\n"
            "heavy = [m for m in ('torch', 'megatron.core', 'megatron_patch.templates') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
