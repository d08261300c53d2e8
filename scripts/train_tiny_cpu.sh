#!/usr/bin/env bash
# Train the tiny MLLM on CPU (gloo) with torchrun, DP 2 by default:
#   bash scripts/train_tiny_cpu.sh [--nproc N] [pretrain_mllm.py FLAGS...]
# --nproc N (or NPROC=N): processes, i.e. TP x PP x DP; --help prints this and pretrain_mllm.py's flags.
# The FLAGS override the defaults below (argparse keeps the last value of a flag), e.g.
#   bash scripts/train_tiny_cpu.sh --train-iters 12 --log-interval 1
#   bash scripts/train_tiny_cpu.sh --nproc 4 --tensor-model-parallel-size 2 --orch-post-balancing
#   bash scripts/train_tiny_cpu.sh --nproc 4 --pipeline-model-parallel-size 2 --num-layers 4 \
#     --num-layers-per-virtual-pipeline-stage 1 --orch-post-balancing    # PP 2 x virtual stages 2 x DP 2
#   bash scripts/train_tiny_cpu.sh --nproc 4 --pipeline-model-parallel-size 2 --orch-post-balancing \
#     --orch-encoder-ranks all    # PP 2 x DP 2, the encoders on every stage (items encoded per rank logged)
# Paths in FLAGS (--data-path, --save, --load, --tensorboard-dir) are relative to the current folder.
# The command line (and a --data-path manifest) is checked once before torchrun starts: a mistake ends
# with its one-line error (pretrain_mllm.py: error: ..., exit status 2). A rank that fails after the
# launch ends the output with its one-line error (exit status 1); ORCH_DEBUG=1 shows the tracebacks.
set -euo pipefail
source "$(dirname "$0")/cli.sh"
repo=$(cd "$(dirname "$0")/.." && pwd)
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
)
help=0
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) help=1 ;;
    --nproc) [ $# -ge 2 ] || die "--nproc needs a number"; nproc=$2; shift ;;
    --nproc=*) nproc=${1#--nproc=} ;;
    *) flags+=("$1") ;;
  esac
  shift
done
[[ $nproc =~ ^[1-9][0-9]*$ ]] || die "--nproc (or NPROC) must be a positive integer, got '$nproc'"
if [ "$help" = 1 ]; then
  usage
  if [ -x "$repo/.venv/bin/python" ]; then
    echo; echo "pretrain_mllm.py's flags:"; "$repo/.venv/bin/python" -m megatron_orch.mllm.task --help
  else
    echo; echo "(pretrain_mllm.py's flags are listed here once the set-up has run: bash scripts/setup_env.sh)"
  fi
  exit 0
fi
bash "$repo/scripts/setup_env.sh"
py=$repo/.venv/bin/python
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=1  # as Megatron-LM launches set it (megatron-core warns otherwise under TP)
WORLD_SIZE=$nproc LOCAL_WORLD_SIZE=$nproc "$py" -m megatron_orch.mllm.task "${flags[@]}"
exec "$py" -m megatron_orch.trainer.launch --standalone --nproc-per-node "$nproc" "$repo/pretrain_mllm.py" \
  "${flags[@]}"
