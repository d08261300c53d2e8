#!/usr/bin/env bash
# Train the tiny MLLM on CPU (gloo) with torchrun: DP ${NPROC:-2} by default. Extra arguments go to
# pretrain_mllm.py and override the defaults below (argparse keeps the last value of a flag), e.g.
#   scripts/train_tiny_cpu.sh --train-iters 12 --log-interval 1
#   NPROC=4 scripts/train_tiny_cpu.sh --tensor-model-parallel-size 2
# The command line (and a --data-path manifest) is checked once before torchrun starts, so a mistake
# ends with its one-line error (pretrain_mllm.py: error: ..., exit status 2), not with torchrun's
# report of failed ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=1  # as Megatron-LM launches set it (megatron-core warns otherwise under TP)
nproc=${NPROC:-2}
flags=(
  --model-config tiny
  --seq-length 256
  --micro-batch-size 2
  --global-batch-size 8
  --train-iters 30
  --lr 1e-3
  --min-lr 1e-4
  --lr-warmup-iters 1
  --lr-decay-style cosine
  --weight-decay 0.01
  --clip-grad 1.0
  --log-interval 1
  "$@"
)
WORLD_SIZE=$nproc LOCAL_WORLD_SIZE=$nproc .venv/bin/python -m megatron_orch.trainer.arguments "${flags[@]}"
exec .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node "$nproc" pretrain_mllm.py "${flags[@]}"
