"""Plants for the engine's resume semantics, --save safety and micro-batch loss scale (issue 27): each breaks one
property; the listed default-lane tests must fail."""
CK = "tests/test_engine_checkpoint.py"

PLANTS = [
    dict(name="schedule-taken-silently", file="megatron_patch/config/resume.py",
         original="    if cfg.override_opt_param_scheduler or cfg.use_checkpoint_opt_param_scheduler:\n        return None",
         replacement="    if cfg.override_opt_param_scheduler or not cfg.use_checkpoint_opt_param_scheduler:\n        return None",
         property="a resume whose schedule flags differ from the checkpoint's is refused (megatron-core's default, "
                  "use_checkpoint_opt_param_scheduler=True, would train on the old schedule with a log line only)",
         tests=[f"{CK}::test_resume_refuses_a_changed_schedule",
                f"{CK}::test_changed_schedule_exits_2_in_one_line_before_launch"]),
    dict(name="past-decay-in-wrong-units", file="megatron_patch/config/resume.py",
         original='return old_ended_with_decay and cfg.train_iters * gbs > scheduler_settings(cfg)["lr_decay_steps"]',
         replacement='return old_ended_with_decay and cfg.train_iters * gbs > scheduler_settings(cfg)["lr_decay_steps"] * gbs',
         property="a longer --train-iters past the end of a decay that ended with the checkpoint's run (same scheduler "
                  "fields, extra iterations at --min-lr 0) is refused",
         tests=[f"{CK}::test_resume_refuses_a_changed_schedule[past_decay]"]),
    dict(name="override-ignored", file="megatron_patch/training/optimizer.py",
         original="        use_checkpoint_opt_param_scheduler=not cfg.override_opt_param_scheduler,\n"
                  "        override_opt_param_scheduler=cfg.override_opt_param_scheduler,",
         replacement="        use_checkpoint_opt_param_scheduler=True,\n        override_opt_param_scheduler=False,",
         property="--override-opt-param-scheduler continues from the checkpoint's step with the new flags' schedule",
         tests=[f"{CK}::test_override_continues_with_the_new_schedule"]),
    dict(name="use-checkpoint-overrides", file="megatron_patch/training/optimizer.py",
         original="        use_checkpoint_opt_param_scheduler=not cfg.override_opt_param_scheduler,\n"
                  "        override_opt_param_scheduler=cfg.override_opt_param_scheduler,",
         replacement="        use_checkpoint_opt_param_scheduler=not (cfg.override_opt_param_scheduler or "
                     "cfg.use_checkpoint_opt_param_scheduler),\n"
                     "        override_opt_param_scheduler=cfg.override_opt_param_scheduler or "
                     "cfg.use_checkpoint_opt_param_scheduler,",
         property="--use-checkpoint-opt-param-scheduler keeps the checkpoint's schedule whatever the flags say",
         tests=[f"{CK}::test_use_checkpoint_keeps_the_old_schedule"]),
    dict(name="override-lr-range-not-applied", file="megatron_patch/training/checkpoint/checkpointer.py",
         original="set_param_group_lr_range(self.optimizer, self.scheduler.max_lr, self.scheduler.min_lr)",
         replacement='set_param_group_lr_range(self.optimizer, stored["max_lr"], stored["min_lr"])',
         property="after loading, the param groups' lr range (which megatron-core's scheduler reads first) is the "
                  "schedule that wins: with override, the new --lr/--min-lr",
         tests=[f"{CK}::test_override_continues_with_the_new_schedule"]),
    dict(name="save-any-load-exempts", file="megatron_patch/config/resume.py",
         original="    if cfg.load and os.path.realpath(cfg.load) == os.path.realpath(save):",
         replacement="    if cfg.load:",
         property="a run that loads one directory never writes into another that holds checkpoints (only resuming "
                  "--save itself is allowed)",
         tests=[f"{CK}::test_save_into_another_runs_checkpoints_is_refused"]),
    dict(name="save-same-model-taken-over", file="megatron_patch/config/resume.py",
         original='        what = (f"the checkpoints of another run (iteration {iteration}; {\', \'.join(diffs)})" if diffs else\n'
                  '                f"checkpoints of this model and layout (iteration {iteration})")',
         replacement='        if not diffs:\n            return None  # same model and layout: the run continues them\n'
                     '        what = f"the checkpoints of another run (iteration {iteration}; {\', \'.join(diffs)})"',
         property="a --save directory with checkpoints of the same model and layout is refused without --load (a rerun "
                  "would re-point the first run's tracker)",
         tests=[f"{CK}::test_save_into_another_runs_checkpoints_is_refused",
                "tests/test_run_gpt_script.py::test_run_gpt_sh_defaults_train_and_save"]),
    dict(name="save-layout-not-compared", file="megatron_patch/config/resume.py",
         original="        if (key in saved) == (key in mine) and saved.get(key) != mine.get(key):",
         replacement="        if (key in saved) != (key in mine) and saved.get(key) != mine.get(key):",
         property="the --save refusal names the layout that differs (TP/PP/DP/ZeRO), compared with the checkpoint's",
         tests=[f"{CK}::test_save_into_another_runs_checkpoints_is_refused",
                f"{CK}::test_save_takeover_exits_2_in_one_line_before_launch",
                "tests/test_run_gpt_script.py::test_run_gpt_sh_defaults_train_and_save"]),
    dict(name="launcher-log-stderr-only", file="pretrain_scripts/launcher.sh",
         original='  exec > >(tee -a "$log") 2> >(tee -a "$log" >&2)',
         replacement='  exec 2> >(tee -a "$log" >&2)',
         property="run_gpt.sh writes everything the job prints (stdout too) to the log file it names",
         tests=["tests/test_run_gpt_script.py::test_run_gpt_sh_defaults_train_and_save"]),
    dict(name="micro-batch-scale-undone", file="megatron_patch/training/loop.py",
         original="        tconfig.grad_scale_func = self.optimizer.scale_loss",
         replacement="        tconfig.grad_scale_func = lambda loss: self.optimizer.scale_loss(loss) * cfg.num_microbatches",
         property="each micro batch's loss is scaled by 1/num-micro-batches (gradients are the global batch's mean)",
         tests=["tests/test_engine_parallel.py::test_one_micro_batch_trains_like_four"]),
    dict(name="reported-loss-divided-in-place", file="megatron_patch/training/step.py",
         original='        return loss, {"lm loss": loss.detach().clone()}',
         replacement='        return loss, {"lm loss": loss.detach()}',
         property="the reported loss is the global batch's mean, not divided by num-micro-batches (the schedule "
                  "divides the returned loss in place)",
         tests=["tests/test_engine_parallel.py::test_one_micro_batch_trains_like_four"]),
]
