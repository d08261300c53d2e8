#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. This is the README's test command; CI runs it on both
# tested set-ups (.ci/run).
#
#   bash scripts/run_tests.sh [--megatron-core VERSION] [PYTEST ARGS...]
#
# --megatron-core 0.19.2 (default: Python 3.12, .venv) or 0.16.1 (Python 3.11, .venv-mcore0.16): see
# scripts/setup_env.sh. Everything else goes to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
setup=()
case "${1:-}" in
  --megatron-core) setup=("$1" "${2:?--megatron-core needs a version}"); shift 2 ;;
  --megatron-core=*) setup=("$1"); shift ;;
  -h|--help) sed -n '2,8s/^# \{0,1\}//p' "$0"; exit 0 ;;
esac
bash scripts/setup_env.sh "${setup[@]}"
venv="$(bash scripts/setup_env.sh "${setup[@]}" --print-venv)"
echo "run_tests.sh: $("$venv/bin/python" -c 'import sys, importlib.metadata as m; print("Python %s, torch %s, megatron-core %s" % (sys.version.split()[0], m.version("torch"), m.version("megatron-core")))')"
exec "$venv/bin/python" -m pytest -q tests "$@"
