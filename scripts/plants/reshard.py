"""Plants for universal resharding (issue 32 item 5): ZeRO-2 at another DP, TP or PP size (SwiGLU's fc1 stored as
TP-global halves, the tied output layer's copy from the embedding, older checkpoints refused / read in order), an
MoE run's optimizer state across expert layouts."""
CK = "tests/test_engine_checkpoint.py"
MOVE = f"{CK}::test_moe_optimizer_state_moves_from_ep2[ep1_zero1_fully_reshardable]"
RULE = f"{CK} -k test_what_an_moe_checkpoint_restores_at_ep1"

ZERO2 = f"{CK}::test_zero2_checkpoint_resumes_at_another_dp_and_tp_size"
FSDP = "megatron_patch/training/checkpoint/fsdp_dtensor.py"
OLD_READ = "tests/test_conversion_io.py::test_reader_puts_an_older_zero2_checkpoints_swiglu_fc1_in_order"
READ = "tests/test_conversion_io.py::test_reader_gives_the_tp1_models_state_dict[llama_tp2pp2_zero2_bf16]"

PLANTS = [
    dict(name="zero2-only-same-layout", file="megatron_patch/config/resume.py",
         original='        manifest.get("optimizer_sharding") != "fully_reshardable")',
         replacement="        True)",
         property="a ZeRO-2 checkpoint resumes at another TP/PP size (refused before this was built)", tests=[ZERO2]),
    dict(name="zero2-older-any-tp", file="megatron_patch/config/resume.py",
         original='        manifest.get("optimizer_sharding") != "fully_reshardable")',
         replacement="        False)",
         property="an older ZeRO-2 checkpoint (fc1 interleaved) at another TP is refused in words", tests=[ZERO2]),
    dict(name="zero2-fully-reshardable-not-recorded", file="megatron_patch/training/checkpoint/checkpointer.py",
         original="2: fsdp_dtensor.FULLY_RESHARDABLE}.get(cfg.zero_stage)",
         replacement="2: None}.get(cfg.zero_stage)",
         property="a ZeRO-2 checkpoint is marked fully reshardable (and stores fc1 split)", tests=[ZERO2]),
    dict(name="zero2-fc1-not-split", file=FSDP,
         original="    if split_swiglu and unwrap(model[0]).config.gated_linear_unit:",
         replacement="    if False:",
         property="SwiGLU's fc1 is stored as TP-global gate and up halves, so it loads at another TP",
         tests=[ZERO2, READ]),
    dict(name="zero2-optimizer-fc1-not-split", file=FSDP,
         original="    _, opt = handle_swiglu_in_state_dict(unwrap(chunk), {}, opt)",
         replacement="    pass",
         property="SwiGLU fc1's Adam moments are stored as TP-global halves too", tests=[ZERO2]),
    dict(name="zero2-tied-copy-not-from-embedding", file=FSDP,
         original="    swap = lambda n: n.replace(TIED_COPY, EMBEDDING) if n.endswith(TIED_COPY) else n  # noqa: E731",
         replacement="    swap = lambda n: n  # noqa: E731",
         property="at PP > 1 the tied output layer's copy loads from a one-stage checkpoint's embedding", tests=[ZERO2]),
    dict(name="reader-older-fc1-not-reordered", file="megatron_patch/conversion/mcore_reader.py",
         original="        if tp > 1:  # an older ZeRO-2 checkpoint's fc1 at TP > 1: [g0; u0; g1; u1] -> [g0; g1; u0; u1]",
         replacement="        if False:",
         property="an older ZeRO-2 checkpoint's interleaved fc1 reads in [gate; up] order", tests=[OLD_READ]),
    dict(name="reader-halves-swapped", file="megatron_patch/conversion/mcore_reader.py",
         original='                              for h in ("w", "v")])',
         replacement='                              for h in ("v", "w")])',
         property="a split fc1 reads as [gate; up]", tests=[READ]),
    dict(name="experts-with-dense-at-ep1", file="megatron_patch/compat/moe.py",
         original='            if getattr(p, "allreduce", True):\n                p.allreduce = False',
         replacement='            if False:\n                p.allreduce = False',
         property="the experts' optimizer state is a part of its own at EP1 too (the same keys at every EP)",
         tests=[MOVE]),
    dict(name="older-ep1-checkpoint-loads-optimizer", file="megatron_patch/config/resume.py",
         original="    experts_move = (same_expert_layout or (apart and cfg.zero_stage != 2)) and not older_ep1",
         replacement="    experts_move = same_expert_layout or (apart and cfg.zero_stage != 2)",
         property="an MoE checkpoint from before the experts were kept apart at EP1 does not load its optimizer state",
         tests=[RULE]),
    dict(name="experts-apart-not-recorded", file="megatron_patch/training/checkpoint/checkpointer.py",
         original='**({"experts_apart": True} if self.cfg.num_experts',
         replacement='**({"experts_apart_": True} if self.cfg.num_experts',
         property="an MoE checkpoint records that its experts' optimizer state is apart", tests=[MOVE]),
]
