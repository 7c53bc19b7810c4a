"""The registry of workarounds: every patch of megatron-core or torch internals is one `Patch` entry.

A `Patch` names the upstream code it depends on or replaces (`"megatron/core/x.py:Class.method"`, as
shipped in the versions it was tested with), says in one sentence what it fixes, and records a
*fingerprint* of that upstream code: the first 16 hex digits of sha256 over `inspect.getsource` of each
upstream object (for objects written in C, which have no Python source, over their docstring, which is
where torch documents their signature and behaviour). tests/test_compat.py recomputes every fingerprint
against the installed packages, so a change upstream fails loudly and names the patch to re-check.

Objects that a patch replaces are replaced through `replace()`, which keeps the original: fingerprints are
always taken over upstream's code, also after the patches are applied, and re-applying is a no-op.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
from typing import Any, Callable, Dict, Tuple, Union

from .versions import TESTED_TEXT

# (owner, attribute name) -> upstream's object, recorded the first time `replace` swaps it.
_ORIGINALS: Dict[Tuple[Any, str], Any] = {}


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str                   # the function's name; unique
    module: str                 # the compat module that defines it
    upstream: Tuple[str, ...]   # "megatron/core/x.py:Class.method" / "torch/cuda/__init__.py:current_device"
    fixes: str                  # what upstream does, and what the patch does instead
    fingerprint: str            # sha256[:16] of the upstream code as shipped in `tested`
    tested: str                 # the versions it was tested with
    function: Callable          # the workaround itself

    def current_fingerprint(self) -> str:
        return fingerprint(self.upstream)


PATCHES: Dict[str, Patch] = {}


def register(*, upstream: Union[str, Tuple[str, ...]], fixes: str, fingerprint: str, tested: str = TESTED_TEXT):
    """Decorator: make the decorated function a registered workaround (see megatron_patch/compat/__init__.py)."""
    def add(fn: Callable) -> Callable:
        ups = (upstream,) if isinstance(upstream, str) else tuple(upstream)
        existing = PATCHES.get(fn.__name__)
        if existing is not None and existing.module != fn.__module__:
            raise ValueError(f"compat patch {fn.__name__!r} is registered twice ({existing.module}, {fn.__module__})")
        PATCHES[fn.__name__] = Patch(fn.__name__, fn.__module__, ups, fixes, fingerprint, tested, fn)
        fn.patch = PATCHES[fn.__name__]
        return fn
    return add


def resolve(upstream: str) -> Any:
    """The upstream object named "path/to/module.py:Qual.name" (upstream's original if a patch replaced it)."""
    path, _, qualname = upstream.partition(":")
    module = path[:-3] if path.endswith(".py") else path
    module = module.replace("/", ".")
    if module.endswith(".__init__"):
        module = module[: -len(".__init__")]
    owner: Any = importlib.import_module(module)
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    key = (owner, parts[-1])
    return _ORIGINALS[key] if key in _ORIGINALS else getattr(owner, parts[-1])


def source(upstream: str) -> str:
    obj = resolve(upstream)
    try:
        return inspect.getsource(obj)
    except (TypeError, OSError):  # written in C: its docstring carries signature and behaviour
        return f"{upstream}\n{obj.__doc__ or ''}"


def fingerprint(upstream: Tuple[str, ...]) -> str:
    text = "\n".join(source(u) for u in upstream)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def original(owner: Any, name: str) -> Any:
    """Upstream's `owner.name`, even after `replace` swapped it."""
    return _ORIGINALS.get((owner, name), getattr(owner, name))


def replace(owner: Any, name: str, new: Any) -> None:
    """Set `owner.name = new`, keeping upstream's object for `original` and the fingerprints. Once only:
    a second call for the same attribute leaves the first replacement in place."""
    key = (owner, name)
    if key in _ORIGINALS:
        return
    _ORIGINALS[key] = getattr(owner, name)
    setattr(owner, name, new)
