"""Hugging Face <-> Megatron checkpoint conversion: one table per model family (tables/), one engine
(mapping.py, transforms.py), readers and writers of both formats, the load-time shim (`--load-hf`), and a
verification that compares logits. `tools/convert_checkpoint.py` is the command line."""
