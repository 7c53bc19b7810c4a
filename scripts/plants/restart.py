"""Plants for automatic restart (issue 32, item 2): each breaks one property; the listed default-lane tests must
fail."""
RESTART = "tests/test_restart.py"
# the default lane's kill-and-restart test (a kill during an --async-save write; the plain one is slow)
KILLED = f"{RESTART}::test_a_worker_killed_during_an_async_save_resumes_from_the_previous_checkpoint"
GIVE_UP = f"{RESTART}::test_an_attempt_resuming_where_the_one_before_did_says_so"

PLANTS = [
    dict(name="restart-does-not-resume", file="megatron_patch/config/restart.py",
         original="    return (cfg.replace(load=load, load_hf=None) if load else cfg), line",
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

# Hang detection (issue 32, item 3)
HANG = "tests/test_hang.py"
STOPPED = f"{HANG}::test_a_stopped_worker_ends_the_job_naming_its_rank"
PLANTS += [
    dict(name="hang-heartbeat-never-stale", file="megatron_patch/parallel/watchdog.py",
         original="            if since > self.heartbeat_timeout_s:",
         replacement="            if since > 1e9:",
         property="a worker whose heartbeat stops ends the job, named",
         tests=[f"{HANG}::test_a_silent_rank_is_named_with_its_last_position", STOPPED]),
    dict(name="hang-heartbeat-not-refreshed", file="megatron_patch/parallel/watchdog.py",
         original="            if r not in self._seen or self._seen[r][0] != rec[\"beat\"]:",
         replacement="            if r not in self._seen:",
         property="a beating worker is not taken for a stopped one",
         tests=[f"{HANG}::test_a_beating_rank_is_not_named_and_a_finished_rank_is_not_expected"]),
    dict(name="hang-finished-rank-still-watched", file="megatron_patch/parallel/watchdog.py",
         original="            if not rec.get(\"done\"):\n                return r",
         replacement="            if True:\n                return r",
         property="a worker that finished is no longer expected to beat",
         tests=[f"{HANG}::test_a_beating_rank_is_not_named_and_a_finished_rank_is_not_expected"]),
    dict(name="hang-step-timeout-ignored", file="megatron_patch/parallel/watchdog.py",
         original="and in_phase > self.step_timeout_s:",
         replacement="and in_phase > 1e9:",
         property="a step longer than --step-timeout-minutes ends the job, naming positions",
         tests=[f"{HANG}::test_a_step_past_the_step_timeout_is_named_with_the_neighbours_position"]),
    dict(name="hang-loop-marks-nothing", file="megatron_patch/training/loop.py",
         original="            watchdog.mark(state.iteration + 1, \"train step\")\n",
         replacement="",
         property="the training loop reports its position to the watchdog",
         tests=[STOPPED]),
    dict(name="hang-heartbeat-rule-missing", file="megatron_patch/config/checks_training.py",
         original="    if c.heartbeat_timeout_seconds >= c.distributed_timeout_minutes * 60:",
         replacement="    if False:",
         property="a heartbeat timeout not shorter than the collectives' is refused before launch",
         tests=[f"{HANG}::test_timeouts_are_checked_before_launch"]),
]

# Asynchronous checkpoints (issue 32, item 4)
ASYNC_KILL = KILLED
PLANTS += [
    dict(name="async-save-stages-live-tensors", file="megatron_patch/compat/checkpoint_writer.py",
         original='[(item, t.to("cpu", copy=True)) for item, t in tensors]',
         replacement='[(item, t.to("cpu")) for item, t in tensors]',
         property="the background write reads a copy staged at the save, not the live weights",
         tests=["tests/test_async_save.py::test_the_background_write_reads_a_copy_staged_at_the_save"]),
    dict(name="async-save-published-before-written", file="megatron_patch/training/checkpoint/checkpointer.py",
         original="        self.async_saver.start(iteration, request, publish)\n",
         replacement="        self.async_saver.start(iteration, request, publish)\n"
                     "        publish_checkpoint(root, iteration, lambda: entries)\n",
         property="an asynchronous checkpoint is published only once every rank has written it",
         tests=[ASYNC_KILL]),
    dict(name="async-save-zero2-accepted", file="megatron_patch/config/checks_training.py",
         original="    if c.async_save and c.zero_2_memory_optimization:",
         replacement="    if False:",
         property="--async-save with ZeRO-2 is refused in words",
         tests=["tests/test_async_save.py::test_async_save_with_zero_2_is_refused_in_words"]),
]

PLANTS += [
    dict(name="hang-stopped-local-worker-left-to-torchrun", file="megatron_patch/parallel/watchdog.py",
         original="                    os.kill(rec[\"pid\"], signal.SIGKILL)\n",
         replacement="                    pass\n",
         property="the watcher kills a stopped worker of its own machine and agent at once (no 30 s SIGTERM grace)",
         tests=[STOPPED]),
]

PLANTS += [
    dict(name="launcher-max-restarts-dropped", file="pretrain_scripts/launcher.sh",
         original='--max-restarts "${MAX_RESTARTS:-0}"', replacement='--max-restarts 0',
         property="the launchers' MAX_RESTARTS reaches torchrun's --max-restarts",
         tests=["tests/test_run_gpt_script.py::test_run_llama_sh_with_tensor_parallel"]),
]

# Optimizer state at another TP (issue 32, item 5, dense ZeRO-0/1)
RESHARD = "tests/test_engine_checkpoint.py"
PLANTS += [
    dict(name="fully-reshardable-step-key-error", file="megatron_patch/training/checkpoint/torch_dist.py",
         original="steps_kept_out(optimizer, optim_sharding == FULLY_RESHARDABLE)",
         replacement="steps_kept_out(optimizer, False)",
         property="a fully reshardable ZeRO-1 checkpoint loads (torch Adam's step is not in its per-parameter tensors)",
         tests=[f"{RESHARD}::test_optimizer_state_moves_from_tp2_to_dp2[zero1_fully_reshardable]"]),
    dict(name="fully-reshardable-not-recorded", file="megatron_patch/config/resume.py",
         original='    fully = manifest.get("optimizer_sharding") == "fully_reshardable"',
         replacement="    fully = False",
         property="a fully reshardable ZeRO-1 checkpoint keeps its optimizer state at another TP",
         tests=[f"{RESHARD}::test_optimizer_state_moves_from_tp2_to_dp2[zero1_fully_reshardable]",
                f"{RESHARD}::test_what_a_tp2_checkpoint_restores_at_tp1"]),
    dict(name="dense-model-held-to-an-expert-layout", file="megatron_patch/config/resume.py",
         original="_expert_layout(saved) == _expert_layout(mine) or not cfg.num_experts",
         replacement="_expert_layout(saved) == _expert_layout(mine)",
         property="a dense model's ZeRO-0 optimizer state follows a TP change (no expert layout to match)",
         tests=[f"{RESHARD}::test_what_a_tp2_checkpoint_restores_at_tp1"]),
]

PLANTS += [
    dict(name="hang-store-gone-ends-at-once", file="megatron_patch/parallel/watchdog.py",
         original="                if time.monotonic() - self._store_lost > self.heartbeat_timeout_s:",
         replacement="                if True:",
         property="a store gone with a finished rank 0 does not end a worker that is still finishing",
         tests=[f"{HANG}::test_a_store_gone_with_a_finished_rank_0_is_given_the_heartbeat_timeout"]),
]

PLANTS += [
    dict(name="rendezvous-port-from-ephemeral-range", file="megatron_patch/ports.py",
         original="    for _ in range(100 if ranges else 0):",
         replacement="    for _ in range(0):",
         property="rendezvous ports come from outside the OS's ephemeral range (no EADDRINUSE against gloo's "
                  "connections)",
         tests=["tests/test_rapidformer_cli.py::test_rendezvous_ports_come_from_outside_the_ephemeral_range"]),
]

PLANTS += [
    dict(name="test-launch-timeout-kills-launcher-only", file="tests/engine_utils.py",
         original="        os.killpg(proc.pid, signal.SIGKILL)\n", replacement="        proc.kill()\n",
         property="a test's torchrun launch that times out takes its workers with it",
         tests=["tests/test_restart.py::test_a_launch_that_times_out_leaves_no_worker_behind"]),
]
