#!/usr/bin/env bash
# Set up (if needed), then train the tiny MLLM on CPU with post-balancing off and on, on the same data,
# and print losses, per-phase imbalance and per-phase times side by side (scripts/compare_baseline.py;
# --help lists its options). Paths are relative to the current folder.
#   bash scripts/compare_baseline.sh [--nproc N] [--out DIR] [--rtol X] [-- extra pretrain_mllm.py flags]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
export ORCH_SCRIPT_NAME=${ORCH_SCRIPT_NAME:-compare_baseline.sh}  # (usage and errors name the script run)
for arg in "$@"; do
  case $arg in
    --) break ;;
    -h|--help) exec python3 "$repo/scripts/compare_baseline.py" --help ;;  # before the set-up: stdlib only
  esac
done
python3 "$repo/scripts/compare_baseline.py" --parse-only "$@"  # a wrong option: refused before the set-up
bash "$repo/scripts/setup_env.sh"
exec "$repo/.venv/bin/python" "$repo/scripts/compare_baseline.py" "$@"
