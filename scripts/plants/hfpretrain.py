"""Plants for the Hugging Face PreTrainer's checkpoints and its dynamic-shape iterator (issue 27 parts 1, 5, 6):
each breaks one property; the listed default-lane tests must fail."""
T = "tests/test_pretrainer.py::"
RESUME = T + "test_hf_pretrainer_falls_back_from_a_damaged_checkpoint_and_resumes_exactly"
REFUSALS = T + "test_hf_checkpoint_selection_and_refusals_in_words"
OTHER_WORLD = T + "test_hf_pretrainer_two_worker_zero1_checkpoint_resumes_on_one_worker"
EQUALIZE = T + "test_dynamic_shape_splits_micro_batches_equally_across_two_workers"

PLANTS = [
    dict(name="hf-validation-position-not-restored", file="megatron_patch/templates/pretrain_hf.py",
         original="build_iterator(valid_ds, cfg, progress.consumed_valid_samples, cycle=True,",
         replacement="build_iterator(valid_ds, cfg, 0, cycle=True,",
         property="a resumed HF PreTrainer run evaluates the validation samples the uninterrupted run evaluates",
         tests=[RESUME]),
    dict(name="hf-validation-position-miscounted", file="megatron_patch/templates/pretrain_hf.py",
         original="progress.consumed_valid_samples += cfg.eval_iters * cfg.global_batch_size",
         replacement="progress.consumed_valid_samples += cfg.eval_iters * cfg.micro_batch_size",
         property="the checkpoint records how many validation samples the evaluations read over all workers",
         tests=[RESUME, OTHER_WORLD]),
    dict(name="hf-manifest-written-before-the-shards", file="megatron_patch/training/checkpoint/atomic.py",
         original="""    write_files(begin_checkpoint(root, iteration))
    return publish_checkpoint(root, iteration, manifest, keep_last_n)
""",
         replacement="""    tmp = begin_checkpoint(root, iteration)
    if _rank() == 0:
        directory.write_manifest(tmp, manifest())
    write_files(tmp)
    _barrier()
    if _rank() == 0:
        directory.publish(tmp, root, iteration)
    _barrier()
    return checkpoint_dir(root, iteration)
""",
         property="the manifest is written last, so its inventory lists every file of the checkpoint with its size "
                  "(written first, it lists none: a missing shard goes unnoticed)",
         tests=[RESUME]),
    dict(name="hf-no-fallback-to-a-complete-checkpoint", file="megatron_patch/training/checkpoint/torch_dcp.py",
         original="    return directory.select_checkpoint(root)\n",
         replacement="    return directory.read_tracker(root), []\n",
         property="a missing or truncated file makes --load fall back to the newest complete checkpoint",
         tests=[RESUME, REFUSALS]),
    dict(name="hf-rng-restore-skipped", file="megatron_patch/training/checkpoint/torch_dcp.py",
         original="        rng.restore(_load_file(_rank_file(path, rank)))\n",
         replacement="        _load_file(_rank_file(path, rank))\n",
         property="a resumed run draws the uninterrupted run's random numbers (dropout)",
         tests=[RESUME]),
    dict(name="hf-scheduler-restore-skipped", file="megatron_patch/training/checkpoint/torch_dcp.py",
         original='    scheduler.load_state_dict(train_state["scheduler"])\n',
         replacement="    scheduler.load_state_dict(scheduler.state_dict())\n",
         property="a resumed run continues the learning-rate schedule where the checkpoint left it",
         tests=[RESUME]),
    dict(name="hf-rank-files-load-with-pickle", file="megatron_patch/training/checkpoint/torch_dcp.py",
         original="        return torch.load(path, weights_only=True)\n",
         replacement="        return torch.load(path, weights_only=False)\n",
         property="loading a checkpoint never runs code it contains (weights_only=True)",
         tests=[REFUSALS]),
    dict(name="hf-optimizer-state-not-flat", file="megatron_patch/training/checkpoint/torch_dcp.py",
         original="options=StateDictOptions(flatten_optimizer_state_dict=True))\n\n\ndef save_checkpoint",
         replacement="options=StateDictOptions(flatten_optimizer_state_dict=False))\n\n\ndef save_checkpoint",
         property="ZeRO-1 optimizer shards saved by 2 workers resume on 1 worker (one entry per parameter name)",
         tests=[OTHER_WORLD]),
    dict(name="hf-empty-param-group-not-hidden", file="megatron_patch/training/checkpoint/torch_dcp.py",
         original="    with _without_empty_groups(_local_optimizer(optimizer)) as optim:\n",
         replacement="    with contextlib.nullcontext(_local_optimizer(optimizer)) as optim:\n",
         property="a ZeRO-1 worker whose local optimizer has an empty param group resumes (DCP's set_state_dict "
                  "fails on it)",
         tests=[T + "test_hf_checkpoint_loads_an_optimizer_with_an_empty_param_group"]),
    dict(name="equalize-takes-the-minimum", file="megatron_patch/data/dynamic_shape.py",
         original="dist.all_reduce(count, op=dist.ReduceOp.MAX)",
         replacement="dist.all_reduce(count, op=dist.ReduceOp.MIN)",
         property="dynamic-shape: every worker runs the same number of micro batches (the fewer are split)",
         tests=[EQUALIZE]),
    dict(name="equalize-split-drops-a-sample", file="megatron_patch/data/dynamic_shape.py",
         original="groups[big:big] = [g[: len(g) // 2], g[len(g) // 2:]]",
         replacement="groups[big:big] = [g[: len(g) // 2], g[len(g) // 2 + 1:]]",
         property="dynamic-shape: splitting a micro batch keeps each of the step's samples once, with its weight",
         tests=[EQUALIZE]),
    dict(name="dynamic-shape-strided-slice", file="megatron_patch/data/dynamic_shape.py",
         original="v[idx][:, :width].contiguous() if",
         replacement="v[idx][:, :width] if",
         property="dynamic-shape micro batches are contiguous (transformers' BERT calls labels.view(-1))",
         tests=[T + "test_dynamic_shape_micro_batches_are_contiguous_at_seq_512"]),
]
