"""Plants for automatic restart (issue 32, item 2): each breaks one property; the listed default-lane tests must
fail."""
RESTART = "tests/test_restart.py"
KILLED = f"{RESTART}::test_killed_worker_restarts_and_finishes_like_an_uninterrupted_run"
GIVE_UP = f"{RESTART}::test_a_run_failing_at_the_same_iteration_stops_when_the_restarts_run_out"

PLANTS = [
    dict(name="restart-does-not-resume", file="megatron_patch/config/restart.py",
         original="    return cfg.replace(load=cfg.save, load_hf=None), line",
         replacement="    return cfg, line",
         property="a restarted attempt resumes from the newest complete checkpoint of --save",
         tests=[KILLED]),
    dict(name="restart-rendezvous-without-attempt-prefix", file="megatron_patch/parallel/initialize.py",
         original="    if attempt == 0 or world == 1:\n        return None",
         replacement="    if True:\n        return None",
         property="a restarted attempt's gloo rendezvous does not read the dead attempt's addresses",
         tests=[KILLED]),
    dict(name="restart-same-iteration-not-named", file="megatron_patch/config/restart.py",
         original="             if previous == iteration else \"\")",
         replacement="             if False else \"\")",
         property="an attempt resuming from the same iteration as the one before says so",
         tests=[GIVE_UP]),
]
