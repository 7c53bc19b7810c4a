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
]
