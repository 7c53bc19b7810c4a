"""megatron_patch: a Megatron-centric 3D-parallel training engine for Transformers.

Submodules: `data` (tokenizers, indexed datasets, preprocessing, GPT/BERT datasets, packing).
"""
__version__ = "0.1.0"
