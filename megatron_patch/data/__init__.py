"""Data: tokenizers, Megatron's indexed (.bin/.idx) format, preprocessing, training datasets, packing."""
