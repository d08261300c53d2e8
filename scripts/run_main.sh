#!/usr/bin/env bash
# The README's main job: set up (if needed), then compare upstream training with post-balancing on
# the tiny MLLM (CPU, gloo, DP 4, data drawn from the real length traces). Takes compare_baseline.sh's
# options (--help lists them); the last line says PASSED or FAILED.
set -euo pipefail
ORCH_SCRIPT_NAME=run_main.sh exec bash "$(dirname "$0")/compare_baseline.sh" "$@"
