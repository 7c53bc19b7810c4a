"""megatron_patch: a Megatron-centric 3D-parallel training engine for Transformers.

The public API of the Rapidformer front end (the white-box templates and what their samples call)::

    from megatron_patch import RapidformerEngine, Finetuner, PreTrainer, get_args, get_logger, get_timers, mpu
    from megatron_patch import build_train_valid_test_datasets_for_huggingface

The names are resolved on first use (PEP 562), so `import megatron_patch` imports neither torch nor megatron-core
and no subpackage imports this module's names back. `rapidformer` re-exports the same objects.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> (module, attribute); attribute None: the module itself
_PUBLIC = {
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

__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'megatron_patch' has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    value = importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
