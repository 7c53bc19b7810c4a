"""Plants for the layering guard (issue 28): each breaks one property; the listed default-lane tests must fail."""
PLANTS = [
    dict(name="config-reads-layout-from-training", file="megatron_patch/config/model_source.py",
         original="    from . import checkpoint_layout as directory  # torch-free: the on-disk layout only",
         replacement="    from megatron_patch.training import checkpoint as directory  # torch-free: the on-disk layout only",
         property="the configuration layer imports nothing from the layers above it (here: the checkpoint layout "
                  "taken from training's package, which re-exports it)",
         tests=["tests/test_layering.py::test_imports_follow_the_layer_order_without_cycles"]),
    dict(name="front-table-imports-its-rules", file="megatron_patch/templates/rules/table.py",
         original="from megatron_patch.config.rule import RuleTable\n",
         replacement="from megatron_patch.config.rule import RuleTable\n\nfrom . import pretrainer  # noqa: F401,E402\n",
         property="no import cycle between modules (the rules table registering its rule modules, which import it)",
         tests=["tests/test_layering.py::test_imports_follow_the_layer_order_without_cycles"]),
    dict(name="manifest-reading-imports-torch", file="megatron_patch/config/checkpoint_layout.py",
         original="import json\n",
         replacement="import json\n\nfrom torch.distributed.checkpoint.api import CheckpointException  # noqa: F401  (DCP's "
                     "per-rank failures, read by refused_unpickling)\n",
         property="reading a checkpoint's manifest (the configuration's --load) imports neither torch nor megatron-core",
         tests=["tests/test_layering.py::test_reading_a_checkpoint_manifest_imports_no_torch"]),
    dict(name="loop-reads-hf-config-from-conversion", file="megatron_patch/training/loop.py",
         original="        hf_config = self.load_weights.hf_config if self.load_weights is not None else None",
         replacement="        from megatron_patch.conversion.hf_io import read_hf_config  # the manifest's config.json\n"
                     "        hf_config = read_hf_config(self.cfg.load_hf) if self.cfg.load_hf else None",
         property="the training loop imports nothing from the conversion (a floor above): --load-hf's config.json "
                  "for the manifest comes from the loader the entry point hands it",
         tests=["tests/test_layering.py::test_imports_follow_the_layer_order_without_cycles"]),
    dict(name="parser-reads-hf-through-conversion", file="megatron_patch/config/arguments.py",
         original="        if hf_architecture is None:\n",
         replacement="        if hf_architecture is None:  # read it here: one parser for every caller\n"
                     "            from megatron_patch.conversion.hf_source import architecture as hf_architecture\n"
                     "        if hf_architecture is None:\n",
         property="the configuration's parser imports nothing from the conversion: --load-hf's architecture is handed "
                  "to it by the entry point's parser (conversion.hf_source.parse_args)",
         tests=["tests/test_layering.py::test_imports_follow_the_layer_order_without_cycles"]),
    dict(name="entry-drops-hf-weights", file="megatron_patch/cli/pretrain.py",
         original="    load_weights = weights_for(cfg)  # --load-hf: the Hugging Face weights, through the family's table",
         replacement="    load_weights = weights_for(cfg) if model == \"bert\" else None",
         property="pretrain_megatron_gpt.py --load-hf DIR trains from DIR's weights (the entry point hands the "
                  "training loop their loader; none given is refused, not trained from random weights)",
         tests=["tests/test_conversion_training.py -k load_hf_first_loss"]),
    dict(name="megatron-run-world-of-one", file="megatron_patch/templates/pretrain_megatron.py",
         original="            self._config = engine_config(self.args).validate(self.world_size)",
         replacement="            self._config = engine_config(self.args).validate(1)",
         property="the PreTrainer's run context (MegatronRun, no module globals) validates the Megatron model's "
                  "configuration for the run's world size, so GPTModel() builds this rank's stage of the TP x PP layout",
         tests=["tests/test_pretrainer.py::test_megatron_gpt_sample_equals_the_engine[tp2_zero2_recompute]"]),
]
