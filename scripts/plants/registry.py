"""Plants for the one flag registry (issue 28 part 1): each breaks one property; the listed default-lane tests must
fail."""
T = "tests/test_flag_registry.py"

PLANTS = [
    dict(name="mask-prob-on-gpt", file="megatron_patch/config/flags.py",
         original='_f("--mask-prob", float, BERT_ONLY | FRONT,',
         replacement='_f("--mask-prob", float, ENGINE | FRONT,',
         property="a BERT-only flag given to pretrain_megatron_gpt.py is refused naming pretrain_megatron_bert.py "
                  "(here the GPT entry point takes --mask-prob and ignores it)",
         tests=[f"{T} -k bert_flag_on_the_gpt"]),
    dict(name="sequence-parallel-on-rapidformer", file="megatron_patch/config/flags.py",
         original='_f("--sequence-parallel", STORE_TRUE, ENGINE,',
         replacement='_f("--sequence-parallel", STORE_TRUE, ALL,',
         property="rapidformer takes exactly the flags it took (an engine-only flag put in its entry set)",
         tests=[f"{T}::test_rapidformer_defaults_are_what_they_were"]),
    dict(name="front-train-iters-default-dropped", file="megatron_patch/config/flags.py",
         original='"optimizer steps (an iteration-based run; pretraining needs it)",\n           front=RULES_CHOOSE),',
         replacement='"optimizer steps (an iteration-based run; pretraining needs it)"),',
         property="rapidformer's --train-iters is None when not given (the front end's rules choose epochs), not "
                  "the engine's 100",
         tests=[f"{T}::test_rapidformer_defaults_are_what_they_were"]),
    dict(name="wrong-entry-skips-equals-form", file="megatron_patch/config/flag_parser.py",
         original='        name = token.split("=", 1)[0]\n',
         replacement="        name = token\n",
         property="--flag=value given to the wrong entry point is refused naming the entry point that takes it, "
                  "as --flag value is",
         tests=[f"{T} -k rapidformer_flag_on_the_engine"]),
    dict(name="engine-defaults-not-suppressed", file="megatron_patch/config/flag_parser.py",
         original="argument_default=argparse.SUPPRESS if engine else None)",
         replacement="argument_default=None)",
         property="the engine's parsers leave a flag not given out of the namespace, so only flags given override "
                  "a --model-family preset",
         tests=[f"{T}::test_engine_defaults_are_configs_and_flags_not_given_are_left_out"]),
    dict(name="front-dest-not-mapped-to-engine", file="megatron_patch/config/flags.py",
         original="return {f.dest_for(RAPIDFORMER): f.dest for f in FLAGS",
         replacement="return {f.dest: f.dest for f in FLAGS",
         property="rapidformer's --torch-compile/--torch-compile-mode reach the engine's compile/compile_mode "
                  "(templates/engine_config.py maps dests through the registry)",
         tests=[f"{T}::test_the_front_end_reaches_the_engine_through_the_registry",
                "tests/test_rapidformer_flags.py::test_megatron_pretrainer_takes_the_compile_mode"]),
    dict(name="zero-3-not-a-switch", file="megatron_patch/config/flags.py",
         original='"sharded (Hugging Face models)", switch=True),',
         replacement='"sharded (Hugging Face models)"),',
         property="the acceleration switches wait for the model: a Hugging Face --task pretraining run's early "
                  "engine Config leaves out ZeRO-3 (which the engine's checks refuse for a Megatron model)",
         tests=["tests/test_rapidformer_megatron.py::test_blackbox_pretraining_refuses_before_any_worker_starts"]),
    dict(name="front-override-ignored-for-dest", file="megatron_patch/config/flags.py",
         original='return self._front_or(entry, "dest", self.dest) or self.dest',
         replacement='return self.dest',
         property="a flag rapidformer names differently (--torch-compile's dest) keeps its front-end dest",
         tests=[f"{T}::test_rapidformer_defaults_are_what_they_were"]),
]
