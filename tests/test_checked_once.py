"""The front end's rules run once, in the launching process (issue 28 part 1): its workers run with the flags as the
rules left them (defaults chosen, notes made) instead of checking the command line again."""
import json

from megatron_patch.cli import launch, main as cli_main, worker
from megatron_patch.config.rapidformer_flags import dump_checked, load_checked, parse_args
from megatron_patch.templates import rules
from megatron_patch.templates.rules import check

SCRIPT = """
import json, sys
from rapidformer import get_args
a = get_args()
json.dump({"lr": a.lr, "notes": a.notes, "argv": sys.argv[1:]}, open(OUT, "w"))
"""


def _script(tmp_path):
    out = tmp_path / "seen.json"
    script = tmp_path / "script.py"
    script.write_text(f"OUT = {str(out)!r}\n" + SCRIPT)
    return script, out


def test_checked_flags_round_trip(tmp_path):
    for argv in (["--task", "sequence_classification", "--pretrained-model-name-or-path", "m", "--data-path", "d",
                  "--text-columns", "a", "b"],
                 ["--user-script", __file__, "--train-iters", "4", "--zero-1-memory-optimization",
                  "--mixed-precision"]):
        args = check(parse_args(argv), world_size=2)
        dump_checked(args, str(tmp_path / "a.json"))
        assert vars(load_checked(str(tmp_path / "a.json"))) == vars(args)


def test_a_worker_runs_with_the_flags_the_launcher_checked(tmp_path, monkeypatch):
    script, out = _script(tmp_path)
    argv = ["--user-script", str(script)]
    args = check(parse_args(argv), world_size=1)
    args.lr = 0.123  # a value no rule would choose: the worker must take the file's flags, not the rules' again
    dump_checked(args, str(tmp_path / "checked.json"))
    monkeypatch.setenv(launch.CHECKED_ARGS, str(tmp_path / "checked.json"))
    assert worker.main(argv) == 0
    seen = json.loads(out.read_text())
    assert seen["lr"] == 0.123 and seen["argv"] == argv and "--lr not given: using 5e-05" in seen["notes"]


def test_the_rules_run_once_for_a_single_worker(tmp_path, monkeypatch):
    script, out = _script(tmp_path)
    calls = []

    def counting(args, world_size):
        calls.append(world_size)
        return check(args, world_size)

    monkeypatch.setattr(rules, "check", counting)  # the launching process imports it from there when it runs
    monkeypatch.setattr(worker, "check", counting)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # recorded, so that what run_workers sets for its in-process worker is undone
        monkeypatch.delenv(key)
    assert cli_main.main(["--user-script", str(script), "--nproc-per-node", "1"]) == 0
    assert calls == [1] and json.loads(out.read_text())["lr"] == 5e-05
