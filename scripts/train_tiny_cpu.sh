#!/usr/bin/env bash
# Train the tiny MLLM on CPU (gloo) with torchrun: DP ${NPROC:-2} by default. Extra arguments go to
# pretrain_mllm.py and override the defaults below (argparse keeps the last value of a flag), e.g.
#   scripts/train_tiny_cpu.sh --train-iters 12 --log-interval 1
#   NPROC=4 scripts/train_tiny_cpu.sh --tensor-model-parallel-size 2
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=1  # as Megatron-LM launches set it (megatron-core warns otherwise under TP)
exec .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" pretrain_mllm.py \
  --model-config tiny \
  --seq-length 256 \
  --micro-batch-size 2 \
  --global-batch-size 8 \
  --train-iters 30 \
  --lr 1e-3 \
  --min-lr 1e-4 \
  --lr-warmup-iters 1 \
  --lr-decay-style cosine \
  --weight-decay 0.01 \
  --clip-grad 1.0 \
  --log-interval 1 \
  "$@"
