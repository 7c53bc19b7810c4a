"""The package's layering, read from its source with `ast` (no module is imported; a few seconds in all).

Every import of a `megatron_patch` module is read, at module level and inside functions, absolute and relative,
and checked against two rules:

(a) The layer order of DESIGN.md: a subpackage imports only from its own layer or below.

        layer 0  compat, config, data          (and the compiled `_C`, and the package's own `__init__`: its
                                               public names resolve on first use, so it imports nothing and any
                                               layer may read `megatron_patch.__version__`; and `ports`, the
                                               torch-free free_port() of every launcher)
        layer 1  models, parallel, accelerations, demo (the demo corpora, once they leave data/)
        layer 2  training
        layer 3  conversion, templates
        layer 4  cli

    Packages of one layer may import each other as long as no cycle results between them (rule b, on
    subpackages); today's arrows inside a layer: data -> _C (the packing helpers), models -> parallel
    (model building logs on rank 0); conversion and templates do not import each other.

(b) No import cycles: neither between modules nor between subpackages. An import's edge goes to the module it
    names (`from pkg import sub` where `sub` is a module goes to `pkg.sub`; `from pkg import name` to `pkg`'s
    `__init__`). Imports under `if TYPE_CHECKING:` (for annotations) are not run and are not edges. The parent
    packages that Python runs on the way (`pkg/__init__` for `pkg.sub`) are not edges:
    every `__init__` that re-exports its children would otherwise close a circle with each of them.

EXCEPTIONS names the imports allowed against the order (an importing module and the module or package it may
reach up to), each with its reason; they are left out of the cycle check between subpackages (an upward import
closes a circle of packages by definition) but not of the one between modules. An exception that is no longer
needed fails the test too, so the list only shrinks.
"""
from __future__ import annotations

import ast
import collections
import json
import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Dict, List, Optional, Set, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "megatron_patch"
PACKAGE = "megatron_patch"

LAYERS: List[Tuple[str, ...]] = [
    ("", "compat", "config", "data", "_C", "ports"),  # ports: a root-level module (free_port)
    ("models", "parallel", "accelerations", "demo", "planning"),  # demo: the demo and test corpora (they read data)
    ("training",),
    ("conversion", "templates"),
    ("cli",),
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}

# (importing module, imported module or package: every module under it) -> why it may go against the layer order.
EXCEPTIONS: Dict[Tuple[str, str], str] = {
    # none: --load-hf, which once needed two (config's parser reading config.json through the conversion's family
    # tables; the training loop loading the weights through them), is assembled by the entry point
    # (cli/pretrain.py: conversion.hf_source gives the parser the architecture and the Trainer its weight loader)
}


def _excepted(src: str, dst: str, exceptions) -> Optional[Tuple[str, str]]:
    """The exception that allows src -> dst, if any."""
    for importer, imported in exceptions:
        if src == importer and (dst == imported or dst.startswith(imported + ".")):
            return importer, imported
    return None


def modules() -> Dict[str, Tuple[pathlib.Path, bool]]:
    """Dotted module name -> (file, is a package's __init__) for every .py file of the package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    for native in ROOT.glob("_C*.so"):  # the compiled extension: a leaf
        out[f"{PACKAGE}._C"] = (native, False)
    out.setdefault(f"{PACKAGE}._C", (ROOT / "_C", False))
    return out


def _known(name: str, mods: Dict) -> str:
    """The longest prefix of `name` that is a module of the package."""
    while name not in mods and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _run_time_nodes(tree: ast.AST):
    """Every node of `tree` except those under `if TYPE_CHECKING:` (imports for annotations, never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def imports(mods: Dict[str, Tuple[pathlib.Path, bool]]) -> List[Tuple[str, str, int]]:
    """Every (importer, imported, line) between modules of the package, function-level imports included."""
    out = []
    for name, (path, is_package) in mods.items():
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        here = name if is_package else name.rsplit(".", 1)[0]
        for node in _run_time_nodes(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                        out.append((name, _known(alias.name, mods), node.lineno))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if not (source == PACKAGE or source.startswith(PACKAGE + ".")):
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    out.append((name, sub if sub in mods else _known(source, mods), node.lineno))
    return sorted(set(out))


def subpackage(module: str) -> str:
    """`megatron_patch.training.loop` -> `training`; the package's own `__init__` -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(edges, mods, exceptions=EXCEPTIONS) -> Tuple[List[str], Set[Tuple[str, str]]]:
    """Imports against the layer order (as lines to print), and the exceptions that were used."""
    bad, used = [], set()
    for src, dst, line in edges:
        a, b = subpackage(src), subpackage(dst)
        if a == b or LAYER[a] >= LAYER[b]:
            continue
        allowed = _excepted(src, dst, exceptions)
        if allowed:
            used.add(allowed)
            continue
        where = _where(mods[src][0])
        bad.append(f"{where}:{line} -> {dst}: {a or PACKAGE} (layer {LAYER[a]}) may import only from its layer "
                   f"or below, not {b or PACKAGE} (layer {LAYER[b]})")
    return bad, used


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one node (Tarjan, iterative), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _where(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT.parent)) if path.is_relative_to(ROOT.parent) else str(path)


def _describe_cycle(component: List[str], edges, mods, key) -> str:
    """The cycle and its arrows; for subpackages only the arrows that do not go down a layer (those close it)."""
    inside = set(component)
    arrows = [f"{_where(mods[s][0])}:{n} -> {d}" for s, d, n in edges
              if key(s) in inside and key(d) in inside and key(s) != key(d)
              and (key is not subpackage or LAYER[subpackage(s)] <= LAYER[subpackage(d)])]
    return "cycle between " + ", ".join(c or PACKAGE for c in component) + ":\n      " + "\n      ".join(arrows)


def check(edges, mods, exceptions=EXCEPTIONS) -> List[str]:
    """Every problem, as lines to print (empty: the layering holds)."""
    problems, used = layer_violations(edges, mods, exceptions)
    problems += [f"exception {src} -> {dst} is no longer needed: remove it from EXCEPTIONS"
                 for src, dst in sorted(set(exceptions) - used)]
    for key in (lambda m: m, subpackage):
        graph: Dict[str, Set[str]] = collections.defaultdict(set)
        for src, dst, _ in edges:
            # an excepted import goes up by definition, so it closes a circle of subpackages; between modules
            # it must close none
            if key(src) != key(dst) and not (key is subpackage and _excepted(src, dst, exceptions)):
                graph[key(src)].add(key(dst))
        problems += [_describe_cycle(c, edges, mods, key) for c in cycles(graph)]
    return problems


def test_every_subpackage_has_a_layer():
    mods = modules()
    missing = sorted({subpackage(m) for m in mods} - set(LAYER))
    assert not missing, f"subpackages without a layer (add them to LAYERS in {__file__}): {missing}"


def test_imports_follow_the_layer_order_without_cycles():
    mods = modules()
    problems = check(imports(mods), mods)
    assert not problems, "the package's layering is broken:\n  " + "\n  ".join(problems)
    assert len(EXCEPTIONS) <= 2, "at most two imports against the layer order (issue 28)"


def test_the_guard_sees_function_level_relative_imports_and_cycles(tmp_path):
    """The reader itself, on two made-up modules: a relative import inside a function is an upward arrow, and
    two modules importing each other are a cycle."""
    (tmp_path / "a.py").write_text("import os\n\n\ndef f():\n    from ..training import loop\n")
    (tmp_path / "loop.py").write_text("from megatron_patch.config.a import f\n")
    mods = {"megatron_patch.config.a": (tmp_path / "a.py", False),
            "megatron_patch.training.loop": (tmp_path / "loop.py", False)}
    edges = imports(mods)
    assert edges == [("megatron_patch.config.a", "megatron_patch.training.loop", 5),
                     ("megatron_patch.training.loop", "megatron_patch.config.a", 1)]
    problems = check(edges, mods, exceptions={})
    upward = f"{tmp_path / 'a.py'}:5 -> megatron_patch.training.loop: config (layer 0)"
    assert any(p.startswith(upward) for p in problems)
    assert any(p.startswith("cycle between megatron_patch.config.a, megatron_patch.training.loop") for p in problems)


def test_reading_a_checkpoint_manifest_imports_no_torch(tmp_path):
    """The configuration reads a checkpoint's stored architecture (for --load) without torch or megatron-core:
    a fresh interpreter writes and publishes a checkpoint directory, reads it back, and has imported neither
    (about 1 s)."""
    code = textwrap.dedent(f"""
        import json, os, sys
        from megatron_patch.config import checkpoint_layout, model_source
        root = {str(tmp_path)!r}
        work = os.path.join(root, "iter_0000003.tmp")
        os.makedirs(work)
        checkpoint_layout.write_manifest(work, {{"iteration": 3, "config": {{"num_layers": 2, "hidden_size": 32}}}})
        checkpoint_layout.publish(work, root, 3)
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron"))
        print(json.dumps([model_source.from_checkpoint(root), heavy]))
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    architecture, heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    assert architecture == {"num_layers": 2, "hidden_size": 32}
    assert heavy == [], f"reading a checkpoint manifest imported {heavy[:5]}"


def test_load_hf_is_read_by_the_entry_points_parser(tmp_path):
    """With no import against the order, --load-hf's config.json is read at the top: the configuration's own parser
    refuses the flag naming the parser that reads it (conversion.hf_source.parse_args, which the entry points use),
    and that one takes the architecture from config.json (in-process, about 1 s)."""
    from megatron_patch.config import ConfigError, parse_args
    from megatron_patch.conversion import hf_source

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 4,
                                                      "n_positions": 64, "vocab_size": 100}))
    flags = ["--load-hf", str(tmp_path), "--mock-data", "--micro-batch-size", "1", "--train-iters", "1"]
    with pytest.raises(ConfigError, match=r"megatron_patch\.conversion\.hf_source\.parse_args"):
        parse_args(flags)
    cfg = hf_source.parse_args(flags)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.model_vocab_size) == (2, 32, 4, 100)
