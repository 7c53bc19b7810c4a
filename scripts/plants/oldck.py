"""Plants for checkpoints of earlier versions (issue 28 part 6): each breaks one property; the listed default-lane
tests must fail."""
PLANTS = [
    dict(name="old-checkpoint-rng-not-restored", file="megatron_patch/training/checkpoint/rng.py",
         original='    get_cuda_rng_tracker().set_states(state["tracker"])',
         replacement='    get_cuda_rng_tracker().get_states()',
         property="a checkpoint written by an earlier version continues exactly (its dropout streams restored)",
         tests=["tests/test_old_checkpoints.py"]),
    dict(name="old-checkpoint-validation-position-dropped", file="megatron_patch/training/checkpoint/checkpointer.py",
         original='manifest["consumed_samples"], manifest.get("consumed_valid_samples", 0))',
         replacement='manifest["consumed_samples"], 0)',
         property="a checkpoint written by an earlier version continues its validation walk where it stood",
         tests=["tests/test_old_checkpoints.py"]),
    dict(name="old-hf-checkpoint-rng-not-restored", file="megatron_patch/training/checkpoint/torch_dcp.py",
         original="        rng.restore(_load_file(_rank_file(path, rank)))\n",
         replacement="        _load_file(_rank_file(path, rank))\n",
         property="an HF PreTrainer checkpoint written by an earlier version continues exactly (dropout streams)",
         tests=["tests/test_old_checkpoints.py -k hf"]),
    dict(name="old-hf-checkpoint-validation-from-0", file="megatron_patch/templates/pretrain_hf.py",
         original="build_iterator(valid_ds, cfg, progress.consumed_valid_samples, cycle=True,",
         replacement="build_iterator(valid_ds, cfg, 0, cycle=True,",
         property="an HF PreTrainer checkpoint written by an earlier version continues its validation walk",
         tests=["tests/test_old_checkpoints.py -k hf"]),
]
