#!/usr/bin/env bash
# The prepared GPU check (issue 8): one script, no network, under 6 minutes on one H200.
#   bash scripts/gpu_check.sh OUT_DIR          # on a GPU machine (NCCL, one GPU)
#   bash scripts/gpu_check.sh --cpu OUT_DIR    # the same steps on CPU (gloo, DP 2, tiny shapes)
# Options in any order; OUT_DIR is relative to the current folder; --help prints this.
# (a) the tiny MLLM trained 8 steps with post-balancing off and on, bf16 and fp32, losses compared
#     (bf16 within 2e-2: the balanced run encodes a step's items in other batches, so GEMMs round
#     differently; fp32 within 1e-3 on GPU, where cuDNN convolutions may use TF32; 1e-5 on CPU);
# (b) the SDPA core attention runs on the fused kernels (scripts/check_sdpa_kernels.py; GPU only) and
#     the MFU benchmark of each phase (python -m megatron_orch.bench.mfu);
# (c) everything under OUT_DIR: env.txt, train_{bf16,fp32}/ (logs, compare.json), one log per step,
#     mfu.json, summary.txt.
# Runs every step even after a failure, then exits non-zero if any failed. Python: $PYTHON, else
# .venv/bin/python, else python3. Where megatron.core does not import and .whl/ exists (the device
# machine: see scripts/fetch_device_wheels.sh), the wheels are installed into /tmp/site first.
set -uo pipefail
source "$(dirname "$0")/cli.sh"
device_options "$@"
cd "$(dirname "$0")/.."
mkdir -p "$out" || exit 1
source scripts/device_steps.sh

{ date -u; "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| cuda', torch.version.cuda, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  "$PY" -c "import megatron.core; print('megatron-core', megatron.core.__version__)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

if [ "$mode" = cpu ]; then
  step train_fp32 300 "$PY" scripts/compare_baseline.py --nproc 2 --out "$out/train_fp32" --rtol 1e-5 -- \
    --global-batch-size 8 --train-iters 8 --distributed-backend gloo
  step train_bf16 300 "$PY" scripts/compare_baseline.py --nproc 2 --out "$out/train_bf16" --rtol 2e-2 -- \
    --global-batch-size 8 --train-iters 8 --distributed-backend gloo --bf16
  step mfu 300 "$PY" -m megatron_orch.bench.mfu --model tiny --quick --device cpu --json "$out/mfu.json"
else
  step train_bf16 150 "$PY" scripts/compare_baseline.py --nproc 1 --out "$out/train_bf16" --rtol 2e-2 -- \
    --global-batch-size 8 --train-iters 8 --distributed-backend nccl --bf16
  step train_fp32 150 "$PY" scripts/compare_baseline.py --nproc 1 --out "$out/train_fp32" --rtol 1e-3 -- \
    --global-batch-size 8 --train-iters 8 --distributed-backend nccl
  step sdpa_kernels 60 "$PY" scripts/check_sdpa_kernels.py
  step mfu 240 "$PY" -m megatron_orch.bench.mfu --model mllm_10b --layers 12,8,4 --device cuda --warmup 1 --repeats 3 \
    --json "$out/mfu.json"
fi

{ echo "gpu_check ($mode) in $out"
  grep -h "largest relative loss difference" "$out"/train_*.log
  if [ ${#failed[@]} -eq 0 ]; then echo "PASSED"; else printf 'FAILED: %s\n' "${failed[@]}"; fi
} | tee "$out/summary.txt"
[ ${#failed[@]} -eq 0 ]
