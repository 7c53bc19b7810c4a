"""Plants for the rapidformer flags that act or are refused (issue 27 part 6, "every flag either acts or is
refused"): each breaks one property; the listed default-lane tests must fail."""
FLAGS = "tests/test_rapidformer_flags.py"

PLANTS = [
    dict(name="blackbox-ft-taken-for-a-script", file="megatron_patch/config/flag_use.py",
         original='            return ("ft",)\n',
         replacement='            return ("finetuner",)\n',
         property="black-box fine-tuning refuses the pretraining data flags it ignores (--split, --data-impl ...); "
                  "only a white-box script's hooks may read them",
         tests=[f"{FLAGS} -k black_box_fine_tuning_refuses"]),
    dict(name="mask-prob-every-task", file="megatron_patch/config/flag_use.py",
         original='    if args.task == "masked_lm":\n',
         replacement='    if args.task in FINETUNE_TASKS:\n',
         property="--mask-prob acts in --task masked_lm only; other fine-tuning tasks refuse it",
         tests=[f"{FLAGS} -k black_box_fine_tuning_refuses"]),
    dict(name="refused-if-any-kind-ignores", file="megatron_patch/config/flag_use.py",
         original="        if all(_unused_in(cells[k], have, model_kind is not None) for k in kinds):\n",
         replacement="        if any(_unused_in(cells[k], have, model_kind is not None) for k in kinds):\n",
         property="a --user-script (Finetuner or PreTrainer, unknown before it runs) is refused only the flags no "
                  "template reads: the seeds' Megatron command (--tensor-model-parallel-size 2) passes",
         tests=[f"{FLAGS} -k seed_commands", f"{FLAGS}::test_scripts_are_refused_only_what_no_template_reads"]),
    dict(name="given-by-value", file="megatron_patch/config/rapidformer_flags.py",
         original="    args.given = _given(argv, vars(args))\n",
         replacement="    args.given = given_flags(argparse.Namespace(**vars(args)))  # differs from its default\n",
         property="a flag given with its default value (--split 969,30,1) counts as given, so it is refused where "
                  "nothing reads it",
         tests=[f"{FLAGS}::test_given_records_what_the_command_line_set",
                f"{FLAGS} -k black_box_fine_tuning_refuses"]),
    dict(name="eval-interval-evaluates-twice", file="megatron_patch/training/evaluation.py",
         original="        if self.each_epoch and self.evaluated != state.iteration:  # unless just evaluated\n",
         replacement="        if self.each_epoch:  # after every epoch\n",
         property="--eval-interval in fine-tuning evaluates every N steps and after each epoch, never twice at "
                  "one step",
         tests=[f"{FLAGS} -k eval_interval"]),
    dict(name="eval-interval-off-by-one", file="megatron_patch/training/evaluation.py",
         original="return bool(self.every) and iteration % self.every == 0\n",
         replacement="return bool(self.every) and (iteration + 1) % self.every == 0\n",
         property="--eval-interval N evaluates after optimizer steps N, 2N, ...",
         tests=[f"{FLAGS} -k eval_interval"]),
    dict(name="ft-dropout-not-in-config", file="megatron_patch/cli/tasks/base.py",
         original="        model = self.auto_class.from_pretrained(self.args.load, **self.model_kwargs(), **settings)\n",
         replacement="        model = self.auto_class.from_pretrained(self.args.load, **self.model_kwargs())\n",
         property="--hidden-dropout, --attention-dropout and --init-method-std reach the model a black-box "
                  "fine-tuning task loads",
         tests=[f"{FLAGS}::test_blackbox_fine_tuning_puts_dropout_and_init_in_the_model_config"]),
    dict(name="causal-positions-not-reset", file="megatron_patch/cli/tasks/pretraining.py",
         original="get_tokenizer().eod, a.reset_position_ids,\n",
         replacement="get_tokenizer().eod, False,\n",
         property="--reset-position-ids restarts positions after each end-of-document token in black-box causal "
                  "pretraining",
         tests=[f"{FLAGS}::test_blackbox_causal_pretraining_masks_eod_loss_and_resets_positions"]),
    dict(name="hf-pretrainer-checks-only-common-flags", file="megatron_patch/templates/pretrainer.py",
         original="        refuse_unused(args, (kind,), error=ConfigError)\n",
         replacement='        refuse_unused(args, (kind, "mg"), error=ConfigError)\n',
         property="a PreTrainer whose model is a Hugging Face/PyTorch one refuses the Megatron-only flags "
                  "(--make-vocab-size-divisible-by, --num-experts, virtual pipeline stages)",
         tests=[f"{FLAGS}::test_hugging_face_pretrainer_refuses_megatron_only_flags"]),
    dict(name="pretraining-model-kind-unchecked", file="megatron_patch/cli/preflight.py",
         original='        refuse_unused(args, ("pt",), model_kind(config))\n',
         replacement='        refuse_unused(args, ("pt",))\n',
         property="--task pretraining refuses the other model kind's data flags (--eod-mask-loss for BERT, "
                  "--mask-prob for a causal LM) before any worker starts",
         tests=[f"{FLAGS}::test_blackbox_pretraining_model_kind_decides_the_data_flags"]),
]
