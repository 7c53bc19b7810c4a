"""Plants for hygiene (issue 28): each breaks one property; the listed default-lane tests must fail.

The package `__init__` exports the public API lazily (PEP 562): each name is the templates' object, and
`import megatron_patch` alone imports neither torch nor the templates.
"""
API = "tests/test_public_api.py"

PLANTS = [
    dict(name="public-api-name-to-wrong-object", file="megatron_patch/__init__.py",
         original='    "PreTrainer": ("megatron_patch.templates.pretrainer", "PreTrainer"),',
         replacement='    "PreTrainer": ("megatron_patch.templates.finetuner", "Finetuner"),',
         property="`from megatron_patch import PreTrainer` is the PreTrainer template (not a copy-pasted neighbour)",
         tests=[f"{API} -k PreTrainer"]),
    dict(name="public-api-imported-eagerly", file="megatron_patch/__init__.py",
         original="import importlib\n",
         replacement="import importlib\n\nfrom megatron_patch.templates import Finetuner  # noqa: F401\n",
         property="`import megatron_patch` stays cheap: no torch, megatron-core or templates until a name is used",
         tests=[f"{API}::test_import_is_cheap_and_lazy"]),
]
