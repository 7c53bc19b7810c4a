"""The on-disk layout of a checkpoint directory, and the rules that keep it consistent.

    {root}/latest_checkpointed_iteration.txt   Megatron's tracker: the newest *published* iteration
    {root}/iter_0000100/                        one checkpoint: the backend's files, then checkpoint.json
    {root}/iter_0000200.tmp/                    a checkpoint being written (or left by a crash)

A checkpoint is written into `iter_N.tmp/`; rank 0 then writes `checkpoint.json` (the training state,
the run's configuration and the size of every file in the directory) as the last file, renames the
directory to `iter_N/`, and only then replaces the tracker. So a crash at any point leaves either the
previous checkpoint named by the tracker or the new one complete. On load, a checkpoint counts as
complete when its `checkpoint.json` is there and every file it lists has the listed size; when the
tracker names one that is not, the newest complete one before it is loaded instead, with a warning
naming both (training repeats a few iterations rather than stopping a long job that a later save will
repair anyway); with no complete checkpoint at all, loading is refused.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from typing import Dict, List, Optional, Tuple

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "checkpoint.json"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the directory and what to do."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    """The iteration named by the tracker file, or None when there is none."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}; write the iteration of the "
                              f"checkpoint to resume (a directory iter_XXXXXXX next to it)")
    return int(text)


def write_tracker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))


def iterations_on_disk(root: str) -> List[int]:
    """Iterations of the published `iter_*` directories under `root`, ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_ITER_DIR.match, os.listdir(root)) if m)


def file_sizes(path: str) -> Dict[str, int]:
    """Relative path -> size of every file under `path` (the manifest's inventory)."""
    sizes = {}
    for dirpath, _, files in os.walk(path):
        for name in files:
            full = os.path.join(dirpath, name)
            sizes[os.path.relpath(full, path)] = os.path.getsize(full)
    return sizes


def write_manifest(path: str, manifest: Dict) -> None:
    """Write checkpoint.json last: the inventory covers every file already in `path`."""
    manifest = dict(manifest, files=file_sizes(path))
    tmp = os.path.join(path, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST))


def publish(tmp: str, root: str, iteration: int) -> None:
    """Rename the finished `tmp` (its manifest written) to `iter_N/`, then point the tracker at it.

    Saving an iteration again (a resumed run writing into its --load directory) keeps the old directory
    until the new one is in place."""
    final = checkpoint_dir(root, iteration)
    old = final + ".old"
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    write_tracker(root, iteration)  # last: only a complete checkpoint is ever named
    shutil.rmtree(old, ignore_errors=True)


def refused_unpickling(e: BaseException) -> Optional[str]:
    """The first line of an unpickling refusal in `e` (torch.load(weights_only=True), the safe-loading
    patches), or inside DCP's per-rank CheckpointException; None when `e` is another error."""
    causes = [e] if isinstance(e, pickle.UnpicklingError) else [exc for exc, _ in getattr(e, "failures", {}).values()]
    for cause in causes:
        if isinstance(cause, pickle.UnpicklingError):
            # torch's weights_only refusals: "GLOBAL m.f was not an allowed global", "unsupported GLOBAL m.f whose
            # module m is blocked"
            found = re.search(r"GLOBAL ([\w.]+)", str(cause))
            return f"refused to unpickle {found.group(1)}." if found else str(cause).splitlines()[0]
    return None


def read_manifest(path: str) -> Dict:
    with open(os.path.join(path, MANIFEST)) as f:
        return json.load(f)


def incomplete_reason(path: str) -> Optional[str]:
    """None when the checkpoint at `path` is complete, else a phrase saying what is wrong."""
    if not os.path.isdir(path):
        return "the directory does not exist"
    try:
        manifest = read_manifest(path)
    except FileNotFoundError:
        return f"it has no {MANIFEST} (its save did not finish)"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"its {MANIFEST} is unreadable ({e})"
    for name, size in manifest.get("files", {}).items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"{name} is missing"
        if os.path.getsize(full) != size:
            return f"{name} has {os.path.getsize(full)} bytes, {size} were written"
    return None


def select_checkpoint(root: str) -> Tuple[Optional[int], List[str]]:
    """(iteration to load or None when `root` holds no checkpoint, warnings to print).

    The tracker's iteration when that checkpoint is complete; otherwise the newest complete one before it."""
    tracked = read_tracker(root)
    on_disk = iterations_on_disk(root)
    if tracked is None and not on_disk:
        return None, []
    warnings = []
    if tracked is None:
        tracked = on_disk[-1]
        warnings.append(f"{root} has no {TRACKER}; taking the newest checkpoint directory, iteration {tracked}")
    reason = incomplete_reason(checkpoint_dir(root, tracked))
    if reason is None:
        return tracked, warnings
    older = [i for i in on_disk if i < tracked and incomplete_reason(checkpoint_dir(root, i)) is None]
    if not older:
        raise CheckpointError(f"{checkpoint_dir(root, tracked)} cannot be loaded: {reason}, and {root} holds no "
                              f"earlier complete checkpoint. Restore the files, point --load at another directory, "
                              f"or start from scratch without --load.")
    warnings.append(f"WARNING: {checkpoint_dir(root, tracked)} is incomplete ({reason}); loading the newest complete "
                    f"checkpoint before it instead: {checkpoint_dir(root, older[-1])}")
    return older[-1], warnings


def prune(root: str, keep: int) -> List[int]:
    """Delete all but the newest `keep` complete checkpoints, and leftovers of interrupted saves.

    The newest complete checkpoint is never deleted (keep >= 1). Returns the deleted iterations."""
    assert keep >= 1
    complete = [i for i in iterations_on_disk(root) if incomplete_reason(checkpoint_dir(root, i)) is None]
    doomed = complete[:-keep]
    for i in doomed:
        shutil.rmtree(checkpoint_dir(root, i), ignore_errors=True)
    newest = complete[-1] if complete else -1
    for name in os.listdir(root):
        m = re.match(r"^iter_(\d{7})\.tmp$", name)
        if m and int(m.group(1)) < newest:  # a save that died before the newest one finished
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return doomed
