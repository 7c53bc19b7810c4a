"""Plants for the parallel-layout planner (issue 32 item 1): each breaks one property; the listed default-lane tests
must fail."""
T = "tests/test_planner.py"
EXACT = f"{T}::test_model_state_bytes_exact_on_every_rank"
RANKS = f"{T}::test_plan_ranks_layouts_that_fit"
MM = "megatron_patch/config/memory_model.py"

PLANTS = [
    dict(name="param-start-unaligned", file=MM, original="PARAM_START_ALIGN = 64", replacement="PARAM_START_ALIGN = 1",
         property="ZeRO-1 buffers align each parameter's start to 64 elements", tests=[EXACT]),
    dict(name="tied-embedding-shares-bucket", file=MM,
         original="            if p.shared_embedding and in_bucket:",
         replacement="            if False and p.shared_embedding and in_bucket:",
         property="the tied embedding/output copy of a pipeline end gets a bucket of its own", tests=[EXACT]),
    dict(name="zero1-shard-of-rank0", file=MM,
         original="        lo, hi = b0 + dp_rank * shard, b0 + (dp_rank + 1) * shard",
         replacement="        lo, hi = b0, b0 + shard",
         property="a ZeRO-1 rank owns its own 1/DP of each bucket (padding falls on the last)", tests=[EXACT]),
    dict(name="experts-over-dense-dp", file=MM,
         original="        size, rank = (edp, edp_rank) if expert else (dp, dp_rank)\n        spans, buckets",
         replacement="        size, rank = (dp, dp_rank)\n        spans, buckets",
         property="expert buffers are sharded over the expert data-parallel group", tests=[EXACT]),
    dict(name="fsdp-pad-without-chunk-factor", file=MM,
         original="        padded = _pad(end, size * factor)", replacement="        padded = _pad(end, size)",
         property="Megatron-FSDP pads a group to DP x its chunk factor", tests=[EXACT]),
    dict(name="engine-reports-rank0-everywhere", file="megatron_patch/training/loop.py",
         original='        metrics["bytes_per_rank"] = [x.tolist() for x in everyone]',
         replacement='        metrics["bytes_per_rank"] = [t.tolist() for x in everyone]',
         property="the engine logs every rank's model-state bytes", tests=[EXACT]),
    dict(name="fit-ignores-device", file="megatron_patch/config/fit.py",
         original="    if need <= device_bytes:", replacement="    if need <= 10 * device_bytes:",
         property="the engine warns when the predicted peak exceeds the GPU's memory",
         tests=[f"{T}::test_engine_warns_before_a_run_that_will_not_fit"]),
    dict(name="plan-slowest-first", file="megatron_patch/planning/search.py",
         original="    ranked.sort(key=lambda p: p.time.total)", replacement="    ranked.sort(key=lambda p: -p.time.total)",
         property="the planner lists the fastest layouts first", tests=[RANKS]),
    dict(name="plan-keeps-what-does-not-fit", file="megatron_patch/planning/search.py",
         original="        if p.fits:\n            ranked.append(p)", replacement="        ranked.append(p)",
         property="the planner lists only layouts that fit the GPU", tests=[RANKS]),
    dict(name="recompute-keeps-everything", file="megatron_patch/config/activation_memory.py",
         original='    full = cfg.recompute_granularity == "full" or',
         replacement='    full = False and cfg.recompute_granularity == "full" or',
         property="full recompute keeps only each layer's input",
         tests=[f"{T}::test_activation_estimate_follows_recompute_and_the_schedule"]),
    dict(name="pipeline-one-in-flight", file="megatron_patch/config/activation_memory.py",
         original="        return float(min(m, pp - pp_rank))", replacement="        return 1.0",
         property="a 1F1B stage holds PP - rank micro batches",
         tests=[f"{T}::test_activation_estimate_follows_recompute_and_the_schedule"]),
]
