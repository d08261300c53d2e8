#!/usr/bin/env bash
# Set up (if needed), then train the tiny MLLM on CPU with post-balancing off and on, on the same data,
# and print losses, per-phase imbalance and per-phase times side by side (scripts/compare_baseline.py).
#   NPROC=4 scripts/compare_baseline.sh [-- extra pretrain_mllm.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python scripts/compare_baseline.py "$@"
