"""The family x layout table of the conversion (issue 29's "a table per family"): for each family's tiny test model
(tests/conversion_utils.py: random weights, vocabulary 1001) and each layout, hf2mcore --verify (max |logit
difference| and top-1 agreement against transformers, fp32), mcore2hf back (every tensor bit for bit against the
original), and the export's greedy generation equal to the original's.

    .venv/bin/python scripts/conversion_matrix.py [--families llama3 qwen3 ...] [--out table.md]

About 40 s per cell on 2 CPU cores. The tests hold the same checks (slow lane: test_conversion_families,
test_conversion_moe; default lane: one layout per family in test_conversion_today).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

DENSE_LAYOUTS = {"TP1": ("1", "1", "1"), "TP2 (one KV group per rank)": ("2", "1", "1"), "PP2": ("1", "2", "1"),
                 "TP2 PP2": ("2", "2", "1")}
MOE_LAYOUTS = {"TP1 EP1": ("1", "1", "1"), "TP2 (one KV group per rank)": ("2", "1", "1"), "PP2": ("1", "2", "1"),
               "EP2": ("1", "1", "2"), "TP2 EP2": ("2", "1", "2")}
FAMILIES = ("llama3", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2")


def main() -> int:
    import torch
    from conversion_utils import (MOE_FAMILIES, assert_same_tensors, generate, read_safetensors_dir, run_convert,
                                  save_hf_model)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=list(FAMILIES))
    p.add_argument("--out", help="also write the table to this file")
    a = p.parse_args()
    rows, failed = [], 0
    with tempfile.TemporaryDirectory(prefix="conversion_matrix_") as work:
        for family in a.families:
            src = save_hf_model(family, os.path.join(work, family))
            reference = generate(src, max_new_tokens=8)
            layouts = MOE_LAYOUTS if family in MOE_FAMILIES else DENSE_LAYOUTS
            for name, (tp, pp, ep) in layouts.items():
                t0 = time.time()
                ck, out = os.path.join(work, f"{family}-{tp}{pp}{ep}"), os.path.join(work, f"{family}-{tp}{pp}{ep}-hf")
                proc = run_convert("--direction", "hf2mcore", "--load-dir", src, "--save-dir", ck, "--verify",
                                   "--target-tensor-model-parallel-size", tp, "--target-pipeline-model-parallel-size", pp,
                                   "--target-expert-model-parallel-size", ep, "--make-vocab-size-divisible-by", "1")
                m = re.search(r"max \|logit difference\| (\S+) .*top-1 agreement (\S+)", proc.stdout)
                verify = (m.group(1), m.group(2)) if proc.returncode == 0 and m else ("FAILED", "-")
                exact = generates = "-"
                if proc.returncode == 0:
                    back = run_convert("--direction", "mcore2hf", "--load-dir", ck, "--save-dir", out, "--no-verify")
                    if back.returncode == 0:
                        try:
                            assert_same_tensors(read_safetensors_dir(src), read_safetensors_dir(out), out)
                            exact = "bit-exact"
                        except AssertionError as e:
                            exact = f"DIFFERS ({str(e)[:60]})"
                        generates = "same tokens" if torch.equal(generate(out, max_new_tokens=8), reference) else "DIFFERENT"
                    else:
                        exact = "EXPORT FAILED"
                ok = verify[0] != "FAILED" and exact == "bit-exact" and generates == "same tokens"
                failed += not ok
                rows.append((family, name, *verify, exact, generates, f"{time.time() - t0:.0f}"))
                print(" | ".join(rows[-1]), flush=True)
    table = ["| family | layout | verify max abs logit diff (fp32) | top-1 agreement | mcore2hf round trip | "
             "export generates | s |", "|---|---|---|---|---|---|---|"]
    table += ["| " + " | ".join(r) + " |" for r in rows]
    print("\n" + "\n".join(table))
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(table) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
