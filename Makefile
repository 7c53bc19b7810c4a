# The two commands of a fresh machine: `make demo` (the main job on a built-in default) and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo data-demo test test-all test-gpu bench clean

$(STAMP): setup.py pyproject.toml csrc/packing.cpp scripts/setup_venv.sh
	bash scripts/setup_venv.sh
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	bash pretrain_scripts/run_gpt.sh

# The lint (ruff, configured in pyproject.toml) first: it takes about a second. Then the default lane on JOBS
# pytest-xdist workers, whole files each (tests/conftest.py hands out the heavy files first), and the tests timed
# against the wall clock (marked serial) alone after it.
JOBS ?= 2
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile -m "not slow and not gpu and not serial" --durations=15
	$(PY) -m pytest -q -m "serial and not slow and not gpu"

test-all: $(STAMP)
	$(PY) -m pytest -q -m "not gpu"

# On a machine with a CUDA GPU: the tests marked gpu (bf16, --compile, ZeRO-1/2, --cpu-offload, resume).
# `make test-gpu PY=python3` uses a Python that already has the package (no .venv is made then).
test-gpu: $(if $(filter $(VENV)/bin/python,$(PY)),$(STAMP))
	$(PY) -m pytest -q -m gpu

bench: $(STAMP)
	$(PY) benchmarks/bench_preprocess.py
	$(PY) benchmarks/bench_packing.py

clean:
	rm -rf $(VENV) build *.egg-info megatron_patch/_C*.so data/demo

data-demo: $(STAMP)
	bash pretrain_scripts/data_demo.sh
