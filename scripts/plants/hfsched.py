"""Plants for the Hugging Face PreTrainer's resume semantics (issue 27 part 4: Megatron-LM's rule for a changed
learning-rate schedule) and its one-line checkpoint errors: each breaks one property; the listed default-lane
tests must fail."""
PT = "tests/test_pretrainer.py"

PLANTS = [
    dict(name="schedule-compared-on-wrong-field", file="megatron_patch/config/resume.py",
         original='("min_lr", "--min-lr")',
         replacement='("max_lr", "--min-lr")',
         property="a resume whose --min-lr differs from the checkpoint's is refused (the comparison reads the "
                  "stored min_lr, not max_lr twice)",
         tests=[f"{PT} -k 'hf_resume_refuses_a_changed_schedule and min_lr'"]),
    dict(name="hf-schedule-counted-in-samples", file="megatron_patch/config/resume.py",
         original='HF = Counting(per_sample=False, warmup_of="--train-iters")',
         replacement='HF = Counting(per_sample=True, warmup_of="--train-iters")',
         property="the HF PreTrainer's LambdaLR counts optimizer steps: another --global-batch-size with the same "
                  "iterations is the same schedule, not refused",
         tests=[f"{PT}::test_hf_resume_schedule_rules"]),
    dict(name="override-ignored", file="megatron_patch/templates/pretrain_hf.py",
         original="        if plan.schedule is not None:\n",
         replacement="        if plan.schedule is not None and plan.from_checkpoint:\n",
         property="--override-opt-param-scheduler continues with this run's schedule and peak lr (not the loaded "
                  "scheduler state's) from the checkpoint's step",
         tests=[f"{PT}::test_hf_override_continues_with_the_new_schedule"]),
    dict(name="stale-lr-first-resumed-step", file="megatron_patch/templates/resume_hf.py",
         original='        group["initial_lr"], group["lr"] = peak, lr\n',
         replacement='        group["initial_lr"] = peak\n',
         property="the first resumed step runs at the chosen schedule's lr at the restored step, not the lr the "
                  "saving run's schedule left in the checkpoint (6 -> 8 iterations ran iteration 7 at lr 0)",
         tests=[f"{PT}::test_hf_override_continues_with_the_new_schedule"]),
    dict(name="use-checkpoint-takes-this-runs-peak", file="megatron_patch/templates/pretrain_hf.py",
         original='peaks, decays = scheduler.base_lrs, state["weight_decay"] or [None] * len(built)',
         replacement='peaks, decays = [p for p, _ in built], state["weight_decay"] or [None] * len(built)',
         property="--use-checkpoint-opt-param-scheduler keeps the checkpoint's peak lr: the run continues exactly "
                  "as the uninterrupted one",
         tests=[f"{PT}::test_hf_use_checkpoint_continues_like_the_uninterrupted_run"]),
    dict(name="use-checkpoint-drops-its-weight-decay", file="megatron_patch/templates/pretrain_hf.py",
         original='peaks, decays = scheduler.base_lrs, state["weight_decay"] or [None] * len(built)',
         replacement='peaks, decays = scheduler.base_lrs, [d for _, d in built]',
         property="--use-checkpoint-opt-param-scheduler keeps the checkpoint's weight decay, not this run's "
                  "--weight-decay",
         tests=[f"{PT}::test_hf_use_checkpoint_continues_like_the_uninterrupted_run"]),
    dict(name="engine-checkpoint-compared-as-hf", file="megatron_patch/templates/resume_hf.py",
         original='    if manifest.get("format") != HF_FORMAT:\n',
         replacement='    if manifest.get("format") is None:\n',
         property="an engine checkpoint given to the HF PreTrainer reaches the loader's refusal (what it is, how to "
                  "load it), not the engine's schedule comparison",
         tests=[f"{PT}::test_hf_resume_schedule_rules"]),
    dict(name="checkpoint-error-not-a-user-error", file="megatron_patch/cli/worker.py",
         original="    return UsageError, ConfigError, DataError, FinetuneDataError, CheckpointError\n",
         replacement="    return UsageError, ConfigError, DataError, FinetuneDataError\n",
         property="a checkpoint --load cannot use (absent, damaged) is one `rapidformer: error:` line with exit 2 "
                  "from any number of workers, no traceback per worker",
         tests=[f"{PT}::test_hf_pretrainer_refusals_are_one_line_exit_2"]),
]
