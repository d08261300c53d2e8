#!/usr/bin/env bash
# Create .venv in the repository (once) and install the package with its test extra.
# Idempotent: a second call only re-checks the install. Needs only python3.11 and the package registries.
# MEGATRON_ORCH_SKIP_SETUP=1 skips the check (an existing .venv, e.g. on a machine without network).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${MEGATRON_ORCH_SKIP_SETUP:-0}" = 1 ] && [ -x .venv/bin/python ]; then
  exit 0
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
stamp=.venv/.orch-installed
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  # torch first, pinned, so pip takes the local CPU build instead of resolving a CUDA one.
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e '.[test]'
  touch "$stamp"
fi
