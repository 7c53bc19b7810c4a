"""Plants for the one torch loop of Hugging Face and plain PyTorch models (issue 28 part 2: templates/torch_loop.py,
its reporter, the torch checkpointer, the shared process-group set-up): each breaks one property; the listed
default-lane tests must fail."""
FT = "tests/test_finetuner_loop.py"
PT = "tests/test_pretrainer.py::"
TL = "tests/test_torch_loop.py::"

PLANTS = [
    dict(name="epoch-stop-rule-one-epoch-late", file="megatron_patch/templates/torch_loop.py",
         original="return epoch_over and self.epochs is not None and progress.epoch >= self.epochs",
         replacement="return epoch_over and self.epochs is not None and progress.epoch > self.epochs",
         property="epochs are a stop rule: --epochs N trains exactly N epochs (each evaluated once after it)",
         tests=[TL + "test_epochs_are_a_stop_rule_and_each_epoch_is_evaluated_once", f"{FT} -k new_order"]),
    dict(name="accumulation-syncs-the-first-micro-batch", file="megatron_patch/templates/torch_loop.py",
         original="with no_sync(model, micro == last):",
         replacement="with no_sync(model, micro == 0):",
         property="gradients are reduced across workers on the last micro batch of an accumulation (all of them "
                  "summed), not on the first",
         tests=[f"{FT}::test_accumulation_trains_like_one_big_batch"]),
    dict(name="dynamic-shape-weights-ignored", file="megatron_patch/templates/torch_loop.py",
         original="weights = list(self.iterator.weights)",
         replacement="weights = [1.0 / count] * count",
         property="dynamic-shape micro batches of unequal sizes are weighted by their share of the step's samples",
         tests=[PT + "test_dynamic_shape_weighs_micro_batches_by_their_samples"]),
    dict(name="reported-loss-summed-over-workers", file="megatron_patch/templates/reporting.py",
         original="            losses /= dist.get_world_size()\n",
         replacement="            losses /= 1\n",
         property="the logged loss is the mean over all workers (a 2-worker run logs the 1-worker run's loss)",
         tests=[PT + "test_hf_pretrainer_two_worker_zero1_checkpoint_resumes_on_one_worker"]),
    dict(name="pending-norms-read-out-of-order", file="megatron_patch/templates/reporting.py",
         original="            for i, v in zip(tensors, read):",
         replacement="            for i, v in zip(tensors, reversed(read)):",
         property="each step's record gets its own gradient norm when the reporter reads the steps since its last "
                  "line in one transfer",
         tests=[TL + "test_each_step_keeps_its_own_loss_and_gradient_norm_when_read_at_the_log_line"]),
    dict(name="close-leaves-steps-unread", file="megatron_patch/templates/reporting.py",
         original="        self._materialize()  # steps after the last line",
         replacement="        pass  # steps after the last line",
         property="steps after the reporter's last line (a stop rule ended the run between two) still get their "
                  "loss and gradient norm",
         tests=[TL + "test_each_step_keeps_its_own_loss_and_gradient_norm_when_read_at_the_log_line"]),
    dict(name="torch-checkpoint-interval-off-by-one", file="megatron_patch/training/checkpoint/state.py",
         original="bool(self.interval and iteration % self.interval == 0)",
         replacement="bool(self.interval and (iteration + 1) % self.interval == 0)",
         property="the torch loop saves a checkpoint after every --save-interval steps (iterations 5 and 10 of 10)",
         tests=[PT + "test_hf_pretrainer_falls_back_from_a_damaged_checkpoint_and_resumes_exactly"]),
    dict(name="workers-start-no-process-group", file="megatron_patch/parallel/initialize.py",
         original="    if (world > 1 or world_of_one) and not dist.is_initialized():\n",
         replacement="    if world_of_one and not dist.is_initialized():\n",
         property="the torch loop's workers join one process group (data parallel: every worker trains on its share "
                  "and the gradients are reduced)",
         tests=[f"{FT}::test_accumulation_trains_like_one_big_batch"]),
    dict(name="partial-accumulation-is-a-step", file="megatron_patch/templates/torch_loop.py",
         original="self.steps_per_epoch = max(1, len(loader) // accum)",
         replacement="self.steps_per_epoch = max(1, -(-len(loader) // accum))",
         property="an epoch has len(loader) // accumulation steps: a trailing part of an accumulation is not a step",
         tests=[TL + "test_epochs_are_a_stop_rule_and_each_epoch_is_evaluated_once"]),
    dict(name="torch-final-checkpoint-only-at-an-interval", file="megatron_patch/training/checkpoint/state.py",
         original="        if stopping:\n            return self.start is None or",
         replacement="        if False:\n            return self.start is None or",
         property="the torch loop saves a checkpoint when training stops, also between two --save-interval steps",
         tests=[TL + "test_checkpointer_saves_every_interval_and_at_the_end_once"]),
    dict(name="torch-resumed-run-saves-again", file="megatron_patch/training/checkpoint/state.py",
         original="return self.start is None or iteration > self.start",
         replacement="return self.start is None or iteration >= self.start",
         property="a resumed run that had nothing left to train writes no checkpoint",
         tests=[TL + "test_checkpointer_saves_every_interval_and_at_the_end_once"]),
    dict(name="torch-save-before-evaluation", file="megatron_patch/templates/torch_loop.py",
         original="                    evaluated = self.validator.after_step(progress)\n"
                  "                    saved = self.checkpointer is not None and bool(self.checkpointer.save(progress))\n",
         replacement="                    saved = self.checkpointer is not None and bool(self.checkpointer.save(progress))\n"
                     "                    evaluated = self.validator.after_step(progress)\n",
         property="at a step that evaluates and saves, the torch loop evaluates first: the checkpoint records the "
                  "validation position after that evaluation, so a resumed run evaluates the batches the "
                  "uninterrupted run would",
         tests=[PT + "test_hf_pretrainer_falls_back_from_a_damaged_checkpoint_and_resumes_exactly"]),
]
