# Sourced by every launcher in pretrain_scripts/ so that they all run the same Python:
#   $PY if set (a path or a command name), else the repository's .venv if present, else the active python3.
# That Python must import megatron_patch; if not, one sentence says so and the launcher exits with 2.
# Sets and exports PY (nested launchers inherit the choice) and PYTHONUNBUFFERED=1 (logs written to files
# and pipes arrive line by line while the job runs, not at exit).
# Needs ROOT (the repository root) to be set by the caller.

resolve_python() {
  local chosen
  if [ -n "${PY:-}" ]; then
    chosen=$(command -v "$PY" 2>/dev/null) || {
      echo "error: PY=$PY is not an executable Python; set PY to a Python with megatron_patch installed, or unset it" >&2
      return 2
    }
  elif [ -x "$ROOT/.venv/bin/python" ]; then
    chosen=$ROOT/.venv/bin/python
  else
    chosen=$(command -v python3 2>/dev/null) || {
      echo "error: no Python found: PY is unset, $ROOT/.venv does not exist (make venv creates it) and python3 is not on PATH" >&2
      return 2
    }
  fi
  case $chosen in /*) ;; *) chosen=$(cd "$(dirname "$chosen")" && pwd)/$(basename "$chosen") ;; esac  # launchers cd
  # Checked once per chain of launchers; from / so that the repository in the working directory does not
  # hide a missing installation (tools/*.py need megatron_patch installed, not merely present).
  if [ "${MEGATRON_PATCH_PY_CHECKED:-}" != "$chosen" ]; then
    if ! (cd / && "$chosen" -c 'import megatron_patch' 2>/dev/null); then
      echo "error: $chosen cannot import megatron_patch; install it into that Python (pip install -e $ROOT), run 'make venv', or set PY=/path/to/python that has it" >&2
      return 2
    fi
    export MEGATRON_PATCH_PY_CHECKED=$chosen
  fi
  export PY=$chosen PYTHONUNBUFFERED=1
}

resolve_python || exit $?
