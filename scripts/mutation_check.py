#!/usr/bin/env python3
"""Plant realistic bugs one at a time and check that the default-lane tests catch each (run by hand, not in CI).

A plant (``scripts/plants/<area>.py``, a list ``PLANTS`` of dicts) names a file, a text that occurs exactly once
in it, the broken replacement, the property it breaks, and the default-lane tests that guard that property
("tests/test_x.py::test_y" or "tests/test_x.py -k words"). For each plant this tool copies the working tree
(tracked and untracked files, not the ignored ones, plus the built C++ helpers) into a scratch directory once,
writes the mutated file, runs ``pytest -m "not slow and not gpu"`` on each listed test in turn until one fails,
and puts the file back. A plant is *caught* when pytest reports failing tests (exit status 1); a collection
error, no test selected, or a timeout is reported as such and counts as not caught.

    python scripts/mutation_check.py                 # every plant, one table at the end
    python scripts/mutation_check.py --list          # the plants, checked for applicability, nothing run
    python scripts/mutation_check.py --area engine --only sched-silent -j 2
    python scripts/mutation_check.py --baseline      # first run each listed test unmutated (must pass)

Exit status 0 when every plant selected is caught (and, with --baseline, every test passes unmutated).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLANT_DIR = os.path.join(ROOT, "scripts", "plants")
MARKERS = "not slow and not gpu"


@dataclass
class Plant:
    name: str
    file: str
    original: str
    replacement: str
    property: str
    tests: List[str]
    area: str = ""

    @property
    def key(self) -> str:
        return f"{self.area}/{self.name}"


@dataclass
class Outcome:
    plant: Plant
    verdict: str  # caught | NOT CAUGHT | error | timeout | inapplicable
    detail: str = ""
    seconds: float = 0.0
    failed: List[str] = field(default_factory=list)


def load_plants(directory: str = PLANT_DIR) -> List[Plant]:
    """Every plant of every ``scripts/plants/*.py``, in file then list order."""
    plants = []
    for path in sorted(glob.glob(os.path.join(directory, "*.py"))):
        area = os.path.splitext(os.path.basename(path))[0]
        if area.startswith("_"):
            continue
        for i, d in enumerate(runpy.run_path(path).get("PLANTS", [])):
            missing = {"name", "file", "original", "replacement", "property", "tests"} - set(d)
            if missing:
                raise SystemExit(f"{path}: plant {i} lacks {', '.join(sorted(missing))}")
            tests = [d["tests"]] if isinstance(d["tests"], str) else list(d["tests"])
            plants.append(Plant(**{**d, "tests": tests}, area=area))
    names = [p.key for p in plants]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SystemExit(f"plant names repeat: {', '.join(dupes)}")
    return plants


def applicability(plant: Plant, root: str = ROOT) -> Optional[str]:
    """None when the plant applies to the tree at `root`, else why not."""
    path = os.path.join(root, plant.file)
    if not os.path.isfile(path):
        return f"{plant.file} does not exist"
    count = open(path, encoding="utf-8").read().count(plant.original)
    if count != 1:
        return f"its original text occurs {count} times in {plant.file} (must be exactly once)"
    if plant.original == plant.replacement:
        return "replacement equals the original"
    return None


def tree_files(root: str) -> List[str]:
    """Tracked and untracked (not ignored) files of the working tree, and the built extension modules."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True,
                         check=True).stdout.decode().split("\0")
    files = [f for f in out if f and os.path.isfile(os.path.join(root, f))]
    files += [os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "megatron_patch", "_C*.so"))]
    return files


def make_scratch(root: str) -> str:
    scratch = tempfile.mkdtemp(prefix="mutation_")
    for rel in tree_files(root):
        dst = os.path.join(scratch, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(os.path.join(root, rel), dst)
    return scratch


def run_pytest(scratch: str, spec: str, timeout: int) -> Tuple[int, str]:
    """(pytest's exit status, or -1 on timeout; its output) for one test spec inside `scratch`."""
    # PY: the launchers (pretrain_scripts/*.sh) take the repository's .venv, which the scratch copy has not; this
    # Python imports the scratch tree through PYTHONPATH
    env = dict(os.environ, PYTHONPATH=scratch, PYTHONDONTWRITEBYTECODE="1", PY=sys.executable)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rf", "-p", "no:cacheprovider", "-m", MARKERS,
           *shlex.split(spec)]
    try:
        proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return -1, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    return proc.returncode, proc.stdout + proc.stderr


def failed_tests(output: str) -> List[str]:
    return re.findall(r"^FAILED (\S+)", output, flags=re.M)


def check_plant(plant: Plant, scratch: str, timeout: int) -> Outcome:
    reason = applicability(plant, scratch)
    if reason:
        return Outcome(plant, "inapplicable", reason)
    path = os.path.join(scratch, plant.file)
    original = open(path, encoding="utf-8").read()
    t0 = time.time()
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(original.replace(plant.original, plant.replacement, 1))
        last = ""
        for spec in plant.tests:
            rc, out = run_pytest(scratch, spec, timeout)
            if rc == 1:
                return Outcome(plant, "caught", spec, time.time() - t0, failed_tests(out))
            if rc == -1:
                return Outcome(plant, "timeout", f"{spec} ran past {timeout} s", time.time() - t0)
            if rc != 0:
                tail = " ".join(out.strip().splitlines()[-1:])
                return Outcome(plant, "error", f"{spec}: pytest exit {rc} ({tail})", time.time() - t0)
            last = spec
        return Outcome(plant, "NOT CAUGHT", f"all passed ({last if len(plant.tests) == 1 else len(plant.tests)})",
                       time.time() - t0)
    finally:
        with open(path, "w", encoding="utf-8") as f:
            f.write(original)


def baseline(specs: List[str], scratch: str, timeout: int) -> Dict[str, Tuple[int, str]]:
    return {s: run_pytest(scratch, s, timeout) for s in specs}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="list the plants and whether each applies; run nothing")
    p.add_argument("--area", nargs="+", help="only the plants of these files of scripts/plants/ (by stem)")
    p.add_argument("--only", nargs="+", help="only the plants of these names")
    p.add_argument("-j", "--jobs", type=int, default=1, help="plants run at once, each in its own scratch copy")
    p.add_argument("--timeout", type=int, default=900, help="seconds per pytest run (default 900)")
    p.add_argument("--baseline", action="store_true", help="first run every listed test unmutated: all must pass")
    a = p.parse_args(argv)

    plants = load_plants()
    if a.area:
        plants = [x for x in plants if x.area in a.area]
    if a.only:
        plants = [x for x in plants if x.name in a.only or x.key in a.only]
    if not plants:
        print("no plants selected", file=sys.stderr)
        return 2
    if a.list:
        bad = 0
        for x in plants:
            reason = applicability(x)
            bad += reason is not None
            print(f"{x.key:40s} {'ok' if reason is None else 'INAPPLICABLE: ' + reason:12s}  {x.property}")
        print(f"{len(plants)} plants, {len(plants) - bad} applicable")
        return 1 if bad else 0

    jobs = max(1, min(a.jobs, len(plants)))
    scratches = [make_scratch(ROOT) for _ in range(jobs)]
    status = 0
    try:
        if a.baseline:
            specs = sorted({s for x in plants for s in x.tests})
            print(f"baseline: {len(specs)} test spec(s) unmutated", flush=True)
            for spec, (rc, out) in baseline(specs, scratches[0], a.timeout).items():
                print(f"  {'pass' if rc == 0 else f'FAIL (exit {rc})'}  {spec}", flush=True)
                if rc != 0:
                    status = 1
                    print("\n".join(out.strip().splitlines()[-15:]), flush=True)
            if status:
                print("baseline failed: fix the tests before judging plants", file=sys.stderr)
                return 1
        free = list(scratches)
        outcomes: List[Outcome] = []

        def work(plant: Plant) -> Outcome:
            scratch = free.pop()
            try:
                return check_plant(plant, scratch, a.timeout)
            finally:
                free.append(scratch)

        with ThreadPoolExecutor(jobs) as pool:
            for out in pool.map(work, plants):
                outcomes.append(out)
                print(f"[{len(outcomes)}/{len(plants)}] {out.plant.key}: {out.verdict} ({out.seconds:.0f} s) "
                      f"{out.failed[0] if out.failed else out.detail}", flush=True)
    finally:
        for s in scratches:
            shutil.rmtree(s, ignore_errors=True)

    print("\n| plant | property | result | failing test |\n|---|---|---|---|")
    for o in outcomes:
        print(f"| {o.plant.key} | {o.plant.property} | {o.verdict} | "
              f"{', '.join(o.failed[:2]) if o.failed else o.detail} |")
    caught = sum(o.verdict == "caught" for o in outcomes)
    print(f"\n{caught} of {len(outcomes)} plants caught")
    return 0 if caught == len(outcomes) and not status else 1


if __name__ == "__main__":
    sys.exit(main())
