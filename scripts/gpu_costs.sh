#!/usr/bin/env bash
# Measured costs on one GPU: calibrate a cost profile, emulate DP ranks with it and with FLOPs,
# simulate the cluster with it. NOT YET RUN ON A GPU.
#   bash scripts/gpu_costs.sh OUT_DIR          # one GPU: mllm_10b widths, 12 ViT / 8 audio / 4 backbone layers
#   bash scripts/gpu_costs.sh --cpu OUT_DIR    # the same steps on CPU with the tiny model (a few minutes)
# Options in any order; OUT_DIR is relative to the current folder; --help prints this.
# Steps, most valuable first, each under its own time limit so that a slow one cannot starve the rest
# (scripts/device_steps.sh: the limits add up to at most 540 s on a GPU). The emulations time each
# distinct call once (--timing shape; backbone lengths in 32-token buckets), plan upstream and the
# trainer's default plan (orch: packed) with the profile and with FLOPs (--compare-flops: both judged on
# the same measurements):
#   calibrate -> profile.yaml, rewritten after every point (a partial one says so in its notes);
#   emulate DP 64; the simulator with the profile at DP 64, 512, 2560; emulate DP 512 (one timed call per
#   shape, no warm-up call: cold shapes included).
# OUT_DIR then holds exactly two files: summary.txt (PASSED or the failed steps) and gpu_costs.tar.gz
# (every step's log, profile.yaml, the JSON and plots). ORCH_DEVICE_DRY_RUN=1 lists the steps and their
# limits and runs nothing.
set -uo pipefail
source "$(dirname "$0")/cli.sh"
device_options "$@"
cd "$(dirname "$0")/.."
source scripts/device_steps.sh

if [ "$mode" = cpu ]; then
  model=(--model tiny); device=(--device cpu); dps=(8 64); limits=(120 150 60 150)
  emulate_opts=(--per-rank 8 --timing shape --compare-flops); first_opts=(--warmup 1 --repeats 3)
  last_opts=(--warmup 1 --repeats 1)
else
  model=(--model mllm_10b --layers 12,8,4); device=(--device cuda); dps=(64 512); limits=(120 180 60 180)
  emulate_opts=(--per-rank 16 --timing shape --llm-bucket 32 --methods orch --compare-flops)
  first_opts=(--warmup 1 --repeats 1); last_opts=(--warmup 0 --repeats 1)
fi
profile="$work/profile.yaml"
plots=1
[ "$dry_run" = 1 ] || "$PY" -c "import matplotlib" 2>/dev/null \
  || { plots=0; echo "matplotlib does not import: JSON only, no plots"; }
plot() { [ "$plots" -eq 1 ] && echo --plot "$work/$1"; }  # plot NAME.png: the --plot flag, when plots work
step calibrate "${limits[0]}" "$PY" -m megatron_orch.bench.calibrate "${model[@]}" "${device[@]}" --warmup 1 \
  --repeats 3 --out "$profile"
step "emulate_dp${dps[0]}" "${limits[1]}" "$PY" -m megatron_orch.bench.emulate "${model[@]}" "${device[@]}" \
  --dp "${dps[0]}" "${emulate_opts[@]}" "${first_opts[@]}" --cost-profile "$profile" \
  --json "$work/emulate_dp${dps[0]}.json" $(plot "emulate_dp${dps[0]}.png")
step sim "${limits[2]}" "$PY" -m megatron_orch.sim "${model[@]}" --dp 64,512,2560 --profile "$profile" \
  --json "$work/sim.json" $(plot sim.png)
step "emulate_dp${dps[1]}" "${limits[3]}" "$PY" -m megatron_orch.bench.emulate "${model[@]}" "${device[@]}" \
  --dp "${dps[1]}" "${emulate_opts[@]}" "${last_opts[@]}" --cost-profile "$profile" \
  --json "$work/emulate_dp${dps[1]}.json"
if [ "$dry_run" != 1 ] && grep -q "PARTIAL profile" "$profile" 2>/dev/null; then
  summarize "calibrate: profile.yaml is PARTIAL (the calibration stopped): $(grep -m1 '^notes:' "$profile")"
fi
finish
