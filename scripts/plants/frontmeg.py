"""Plants for the rapidformer front end with Megatron models (issue 27 part 6): MoE with default biases, worker
errors as one line with exit 2, --cpu-offload / ONNX Runtime refusals, per-rank noise. Each breaks one property;
the listed default-lane tests must fail."""
T = "tests/test_rapidformer_megatron.py"
PLANTS = [
    dict(name="status-dir-not-passed", file="megatron_patch/cli/launch.py",
         original="env={**env, status.ENV: directory, CHECKED_ARGS: checked})",
         replacement="env={**env, CHECKED_ARGS: checked})",
         property="2 workers: the launcher no longer hears the workers' usage error: each rank exits 2, torchrun "
                  "prints ChildFailedError and `rapidformer` exits 1 instead of 2",
         tests=[f"{T}::test_worker_configuration_error_is_one_line_and_exit_2"]),
    dict(name="worker-exits-2-under-torchrun", file="megatron_patch/cli/status.py",
         original="        os.replace(path + \".tmp\", path)  # the launcher never reads half a message\n        return 0",
         replacement="        os.replace(path + \".tmp\", path)  # the launcher never reads half a message\n"
                     "        return USAGE_ERROR",
         property="a worker that reported its usage error exits 2 under torchrun: torchrun's ChildFailedError "
                  "traceback reaches the user",
         tests=[f"{T}::test_worker_configuration_error_is_one_line_and_exit_2",
                f"{T}::test_usage_error_status_reaches_the_launcher"]),
    dict(name="launcher-prints-every-rank", file="megatron_patch/cli/status.py",
         original="    with open(min(reports)[1], encoding=\"utf-8\") as f:\n        return f.read()",
         replacement="    return \"\\n\".join(open(p, encoding=\"utf-8\").read() for _, p in sorted(reports))",
         property="the error is printed once per worker instead of once",
         tests=[f"{T}::test_worker_configuration_error_is_one_line_and_exit_2",
                f"{T}::test_usage_error_status_reaches_the_launcher"]),
    dict(name="moe-bias-patch-not-applied", file="megatron_patch/models/gpt.py",
         original="    if cfg.num_experts and not cfg.disable_bias_linear:\n"
                  "        from megatron_patch.compat.moe import one_rank_reductions_are_identity",
         replacement="    if cfg.num_experts and cfg.disable_bias_linear:\n"
                     "        from megatron_patch.compat.moe import one_rank_reductions_are_identity",
         property="MoE with the default linear biases: megatron-core's in-place expert bias add fails at expert "
                  "tensor/model-parallel size 1 (the view error)",
         tests=[f"{T}::test_moe_with_linear_biases_trains_like_the_single_process_at_tp2",
                f"{T}::test_moe_sample_trains_with_default_biases_on_two_workers_quietly"]),
    dict(name="expert-bias-grad-summed-over-tp", file="megatron_patch/models/gpt.py",
         original="if cfg.num_experts and not cfg.disable_bias_linear and cfg.sequence_parallel:",
         replacement="if cfg.num_experts and not cfg.disable_bias_linear and cfg.sequence_parallel and "
                     "cfg.expert_model_parallel_size > 1:",
         property="expert linear_fc2 bias gradients summed over TP on top of expert-DP at EP 1 (TP x too large)",
         tests=[f"{T}::test_moe_with_linear_biases_trains_like_the_single_process_at_tp2"]),
    dict(name="rapidformer-moe-tp-splits-experts", file="megatron_patch/templates/engine_config.py",
         original="values.setdefault(\"expert_tensor_parallel_size\", 1)",
         replacement="values.setdefault(\"expert_tensor_parallel_size\", tp)",
         property="rapidformer MoE with TP2 keeps the experts split (ETP = TP): megatron-core's expert biases "
                  "cannot run, the user's command is refused",
         tests=[f"{T}::test_moe_sample_trains_with_default_biases_on_two_workers_quietly"]),
    dict(name="cpu-offload-asks-for-zero-first", file="megatron_patch/config/checks_training.py",
         original="    if not probes._has_gpu():  # before the ZeRO rule",
         replacement="    if not probes._has_gpu() and c.zero_stage in (1, 2):  # before the ZeRO rule",
         property="--cpu-offload on a machine without a GPU: 'add ZeRO' without the flag, 'drop the flag' with it",
         tests=[f"{T}::test_cpu_offload_answer_does_not_depend_on_the_zero_flag",
                f"{T}::test_worker_configuration_error_is_one_line_and_exit_2", "tests/test_config.py -k rejections"]),
    dict(name="ort-on-megatron-not-checked", file="megatron_patch/templates/rules/megatron_model.py",
         original="    if getattr(args, \"onnx_runtime_training\", False):",
         replacement="    if getattr(args, \"onnx_runtime\", False):",
         property="--onnx-runtime-training with a Megatron model is silently ignored instead of refused in words",
         tests=[f"{T}::test_onnx_runtime_on_a_megatron_model_is_refused_as_a_hugging_face_switch"]),
    dict(name="cpu-backend-line-every-rank", file="megatron_patch/compat/__init__.py",
         original="    if int(os.environ.get(\"RANK\", \"0\")) == 0:  # the same on every rank: said once",
         replacement="    if int(os.environ.get(\"LOCAL_RANK\", \"0\")) >= 0:  # the same on every rank: said once",
         property="'no GPU found: running megatron-core on the CPU' printed by every rank",
         tests=[f"{T}::test_moe_sample_trains_with_default_biases_on_two_workers_quietly",
                f"{T}::test_moe_with_linear_biases_trains_like_the_single_process_at_tp2"]),
    dict(name="quiet-rank0-inverted", file="megatron_patch/compat/quiet.py",
         original="(\"rank0\" in scope and _rank() != 0)",
         replacement="(\"rank0\" in scope and _rank() == 0)",
         property="messages meant for rank 0 only (LOAD REPORT, CUDA_DEVICE_MAX_CONNECTIONS) shown by the other "
                  "ranks and hidden on rank 0",
         tests=[f"{T}::test_transformers_load_report_is_printed_by_rank_0_only"]),
    dict(name="blackbox-pretraining-not-checked-up-front", file="megatron_patch/templates/rules/__init__.py",
         original="    if args.task != \"pretraining\" or args.user_script:\n        return None\n    if args.num_experts:",
         replacement="    if args.task != \"pretraining\" or not args.user_script:\n        return None\n    if args.num_experts:",
         property="--task pretraining's settings (and --num-experts) are no longer refused before workers start",
         tests=[f"{T}::test_blackbox_pretraining_refuses_before_any_worker_starts"]),
    dict(name="ort-fp16-line-says-eager-cpu", file="megatron_patch/accelerations/precision.py",
         original="            slower = \"about 1.7x\" if onnx_runtime else \"about 10x\"",
         replacement="            slower = \"about 10x\"",
         property="with ONNX Runtime the fp16 log line claims PyTorch's eager CPU slowdown instead of saying that "
                  "fp16 runs inside ORT's graph at 1.7x",
         tests=[f"{T}::test_precision_line_says_where_fp16_runs_under_onnx_runtime"]),
    dict(name="grouped-gemm-bias-unchecked", file="megatron_patch/config/checks_layout.py",
         original="    if not c.disable_bias_linear:\n        return (\"--moe-grouped-gemm computes",
         replacement="    if c.add_qkv_bias:\n        return (\"--moe-grouped-gemm computes",
         property="--moe-grouped-gemm with the default linear biases passes validate() and fails later, at model "
                  "build, with a traceback from every rank",
         tests=[f"{T}::test_engine_moe_bias_limits_in_one_sentence_each"]),
]
