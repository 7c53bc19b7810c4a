"""Plants for the layering guard (issue 28): each breaks one property; the listed default-lane tests must fail."""
PLANTS = [
    dict(name="config-reads-layout-from-training", file="megatron_patch/config/model_source.py",
         original="    from . import checkpoint_layout as directory  # torch-free: the on-disk layout only",
         replacement="    from megatron_patch.training import checkpoint as directory  # torch-free: the on-disk layout only",
         property="the configuration layer imports nothing from the layers above it (here: the checkpoint layout "
                  "taken from training's package, which re-exports it)",
         tests=["tests/test_layering.py::test_imports_follow_the_layer_order_without_cycles"]),
    dict(name="engine-config-logs-through-globals", file="megatron_patch/templates/engine_config.py",
         original="from .logger import get_logger\n",
         replacement="from .globals import get_logger\n",
         property="no import cycle between modules (globals -> rules -> engine_config -> globals)",
         tests=["tests/test_layering.py::test_imports_follow_the_layer_order_without_cycles"]),
    dict(name="manifest-reading-imports-torch", file="megatron_patch/config/checkpoint_layout.py",
         original="import json\n",
         replacement="import json\n\nfrom torch.distributed.checkpoint.api import CheckpointException  # noqa: F401  (DCP's "
                     "per-rank failures, read by refused_unpickling)\n",
         property="reading a checkpoint's manifest (the configuration's --load) imports neither torch nor megatron-core",
         tests=["tests/test_layering.py::test_reading_a_checkpoint_manifest_imports_no_torch"]),
]
