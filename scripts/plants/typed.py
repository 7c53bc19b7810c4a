"""Plants for the typed configuration (issue 28 part 1): each breaks one property; the listed default-lane tests
must fail."""
T = "tests/test_typed_config.py"
PLANTS = [
    dict(name="mixed-precision-as-bf16", file="megatron_patch/config/config.py",
         original="flat[\"precision\"] = Precision.BF16 if bf16 else Precision.FP16",
         replacement="flat[\"precision\"] = Precision.FP16 if fp16 else Precision.BF16",
         property="Rapidformer's --mixed-precision (fp16) becomes bf16 in the typed configuration",
         tests=[f"{T}::test_zero_and_precision_are_enums_read_by_the_flags_names"]),
    dict(name="zero-stage-counted", file="megatron_patch/config/config.py",
         original="        flat[\"zero_stage\"] = zero[0]",
         replacement="        flat[\"zero_stage\"] = len(zero)",
         property="--zero-2-memory-optimization gives ZeRO stage 1 (the number of ZeRO flags, not the stage)",
         tests=[f"{T}::test_zero_and_precision_are_enums_read_by_the_flags_names"]),
    dict(name="old-stored-booleans-dropped", file="megatron_patch/config/config.py",
         original="if (k in HOME or k in FLAG_NAMES) and k != \"checked\"})",
         replacement="if k in HOME and k != \"checked\"})",
         property="a checkpoint stored before issue 28 (ZeRO and precision as the flags' booleans) loads as fp32 "
                  "without ZeRO",
         tests=[f"{T}::test_a_stored_configuration_of_either_form_loads"]),
    dict(name="replace-drops-a-section", file="megatron_patch/config/config.py",
         original="return Config(**{name: getattr(self, name) for name in SECTIONS}, **settings)",
         replacement="return Config(**{name: getattr(self, name) for name in SECTIONS if name != \"checkpoint\"}, "
                     "**settings)",
         property="cfg.replace(...) resets the settings of another section (here --save/--load) to their defaults",
         tests=[f"{T}::test_each_setting_lives_in_one_frozen_section_and_reads_flat"]),
    dict(name="resolve-creates-save", file="megatron_patch/config/validate.py",
         original="    per_step = c.micro_batch_size * dp\n",
         replacement="    per_step = c.micro_batch_size * dp\n    if c.save:\n        os.makedirs(c.save, exist_ok=True)\n",
         property="resolve() does I/O again (creates --save), so deriving settings touches the file system",
         tests=[f"{T}::test_resolve_is_pure_and_fills_the_dependent_settings"]),
    dict(name="replace-keeps-checked", file="megatron_patch/config/config.py",
         original="        settings.setdefault(\"checked\", False)\n",
         replacement="",
         property="a validated Config changed by replace() still counts as checked, so the process-group set-up "
                  "skips the rules for settings nobody checked",
         tests=[f"{T}::test_a_validated_configuration_is_checked_once"]),
    dict(name="single-worker-checks-again", file="megatron_patch/cli/launch.py",
         original="        from .worker import run\n\n        return run(args, argv)",
         replacement="        from .worker import main as run\n\n        return run(argv)",
         property="rapidformer's single worker parses and checks the command line again instead of running with "
                  "the flags the launching process checked (the rules run twice)",
         tests=["tests/test_checked_once.py::test_the_rules_run_once_for_a_single_worker"]),
    dict(name="worker-ignores-checked-flags", file="megatron_patch/cli/worker.py",
         original="        checked = os.environ.get(CHECKED_ARGS)",
         replacement="        checked = None",
         property="torchrun workers ignore the flags the launching process checked and run the rules again",
         tests=["tests/test_checked_once.py::test_a_worker_runs_with_the_flags_the_launcher_checked"]),
]
