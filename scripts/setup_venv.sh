#!/usr/bin/env bash
# Create .venv with a Python >= 3.12 and install megatron_patch (editable, with test extras) into it.
# Used by `make demo` and `make test`; safe to run again (pip skips what is installed).
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local cand out
  for cand in "${PYTHON:-}" python3.12 python3.13 python3.14 python3; do
    [ -n "$cand" ] || continue
    for pyenv_version in "" 3.12; do
      out=$(PYENV_VERSION=$pyenv_version "$cand" -c 'import sys; print(int(sys.version_info >= (3, 12)))' 2>/dev/null) || continue
      if [ "$out" = 1 ]; then
        PYENV_VERSION=$pyenv_version "$cand" -c 'import sys; print(sys.executable)'
        return 0
      fi
    done
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  if ! PY=$(find_python); then
    echo "error: megatron_patch needs Python >= 3.12 (megatron-core 0.19 requires it), and none was found" >&2
    echo "       (tried \$PYTHON, python3.12, python3.13, python3.14, python3). Install one, or set PYTHON=/path/to/python3.12." >&2
    exit 1
  fi
  echo "creating .venv with $PY"
  "$PY" -m venv .venv
fi
# The pip config of some machines lists local mirrors that do not exist; those warnings are noise.
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
echo "installing megatron_patch and its dependencies into .venv (first time: a few minutes, torch is large)"
set -o pipefail
# pip compiles the bytecode of torch & co. at install (about a minute on 2 cores). Not --no-compile: where
# PYTHONDONTWRITEBYTECODE is set (CI machines) Python then never writes it, and every process the tests start
# compiles torch, transformers and megatron-core again: 15 s instead of 7 s per import, the whole lane 2x slower.
.venv/bin/python -m pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || {
  echo "error: installing megatron_patch failed (see above)" >&2; exit 1; }
.venv/bin/python -c "import megatron_patch._C, megatron.core, torch; print('ready: torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
