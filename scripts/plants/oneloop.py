"""Plants for the one torch loop of Hugging Face and plain PyTorch models (issue 28 part 2: templates/torch_loop.py,
its reporter, the torch checkpointer, the shared process-group set-up): each breaks one property; the listed
default-lane tests must fail."""
FT = "tests/test_finetuner_loop.py"
PT = "tests/test_pretrainer.py::"

PLANTS = [
    dict(name="epoch-stop-rule-one-epoch-late", file="megatron_patch/templates/torch_loop.py",
         original="return epoch_over and self.epochs is not None and progress.epoch >= self.epochs",
         replacement="return epoch_over and self.epochs is not None and progress.epoch > self.epochs",
         property="epochs are a stop rule: --epochs N trains exactly N epochs (each evaluated once after it)",
         tests=[f"{FT} -k new_order", f"{FT} -k evaluat"]),
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
         original="        value /= dist.get_world_size()\n",
         replacement="        value /= 1\n",
         property="the logged loss is the mean over all workers (a 2-worker run logs the 1-worker run's loss)",
         tests=[PT + "test_hf_pretrainer_two_worker_zero1_checkpoint_resumes_on_one_worker"]),
    dict(name="torch-checkpoint-interval-off-by-one", file="megatron_patch/training/checkpoint/torch_dcp.py",
         original="bool(self.interval and progress.step % self.interval == 0)",
         replacement="bool(self.interval and (progress.step + 1) % self.interval == 0)",
         property="the torch loop saves a checkpoint after every --save-interval steps (iterations 5 and 10 of 10)",
         tests=[PT + "test_hf_pretrainer_falls_back_from_a_damaged_checkpoint_and_resumes_exactly"]),
    dict(name="workers-start-no-process-group", file="megatron_patch/parallel/initialize.py",
         original="    if (world > 1 or world_of_one) and not dist.is_initialized():\n",
         replacement="    if world_of_one and not dist.is_initialized():\n",
         property="the torch loop's workers join one process group (data parallel: every worker trains on its share "
                  "and the gradients are reduced)",
         tests=[f"{FT}::test_accumulation_trains_like_one_big_batch"]),
]
