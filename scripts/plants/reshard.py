"""Plants for universal resharding (issue 32 item 5): ZeRO-2 at another DP size, an MoE run's optimizer state
across expert layouts."""
CK = "tests/test_engine_checkpoint.py"
MOVE = f"{CK}::test_moe_optimizer_state_moves_from_ep2[ep1_zero1_fully_reshardable]"
RULE = f"{CK} -k test_what_an_moe_checkpoint_restores_at_ep1"

ZERO2 = f"{CK}::test_zero2_checkpoint_resumes_at_another_dp_size"

PLANTS = [
    dict(name="zero2-only-same-layout", file="megatron_patch/training/checkpoint/checkpointer.py",
         original='        if self.format == fsdp_dtensor.FORMAT and {**saved, "dp": 0} != {**mine, "dp": 0}:',
         replacement="        if self.format == fsdp_dtensor.FORMAT and saved != mine:",
         property="a ZeRO-2 checkpoint resumes at another DP size", tests=[ZERO2]),
    dict(name="zero2-any-tp", file="megatron_patch/training/checkpoint/checkpointer.py",
         original='        if self.format == fsdp_dtensor.FORMAT and {**saved, "dp": 0} != {**mine, "dp": 0}:',
         replacement="        if False:",
         property="a ZeRO-2 checkpoint at another TP is refused in words", tests=[ZERO2]),
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
