#!/usr/bin/env bash
# The README's main job: set up (if needed), then compare upstream training with post-balancing on
# the tiny MLLM (CPU, gloo, DP 4, data drawn from the real length traces).
set -euo pipefail
exec bash "$(dirname "$0")/compare_baseline.sh" "$@"
