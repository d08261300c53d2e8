#!/usr/bin/env bash
# Create the repository's virtual environment (once), install the package with its test and energon extras and
# compile its planning kernels (numba's cache); each step is announced with its size and time.
#
#   bash scripts/setup_env.sh [--megatron-core VERSION] [--print-venv]
#
# Two supported set-ups, the two ends of the tested range megatron-core 0.16.1 .. 0.19.x:
#   0.19.2 (default)  Python 3.12, venv .venv: torch 2.13.0 from the registry (PyPI's CUDA build, ~5 GB;
#                     it runs on CPU), triton (megatron-core >= 0.18 imports it), megatron-core 0.19.2
#   0.16.1            Python 3.11, venv .venv-mcore0.16: torch 2.13.0 (the CPU build on this project's
#                     machines), megatron-core 0.16.1 (the newest release for Python 3.11)
# Both: megatron-energon 7.4.1 (pure Python; Energon datasets as --data-path, and its tests).
# --print-venv prints the set-up's venv folder and does nothing else.
# Python is $PYTHON when set, else python3.X on PATH, else pyenv's; none found is a one-line error.
# Idempotent: a second call only re-checks the stamp. MEGATRON_ORCH_SKIP_SETUP=1 skips the check where
# the venv exists (e.g. on a machine without network). Exact versions live here only; setup.py has ranges.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "setup_env.sh: error: $*" >&2; exit 1; }
usage() { sed -n '2,15s/^# \{0,1\}//p' "$0"; }

mcore=0.19.2
print_venv=0
while [ $# -gt 0 ]; do
  case "$1" in
    --megatron-core) [ $# -ge 2 ] || die "--megatron-core needs a version (0.19.2 or 0.16.1)"; mcore=$2; shift 2 ;;
    --megatron-core=*) mcore=${1#*=}; shift ;;
    --print-venv) print_venv=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

energon=megatron-energon==7.4.1
case "$mcore" in
  0.19.2) python_version=3.12; venv=.venv; packages=(torch==2.13.0 triton megatron-core==0.19.2 einops==0.8.1 "$energon")
          packages_size="torch's CUDA build with its NVIDIA libraries, ~5 GB: ~1-3 min"; setup_time="~4-5 min on an idle 2-core machine" ;;
  0.16.1) python_version=3.11; venv=.venv-mcore0.16; packages=(torch==2.13.0 megatron-core==0.16.1 einops==0.8.1 "$energon")
          packages_size="torch's CPU build, ~200 MB: under a minute"; setup_time="~2-3 min on an idle 2-core machine" ;;
  *) die "--megatron-core $mcore is not a tested set-up: choose 0.19.2 (Python 3.12, the default) or 0.16.1 (Python 3.11)" ;;
esac

if [ $print_venv = 1 ]; then
  echo "$venv"
  exit 0
fi
if [ "${MEGATRON_ORCH_SKIP_SETUP:-0}" = 1 ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi

runs_version() {  # does "$1" run and report Python $python_version?
  [ -n "$1" ] && "$1" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$python_version'.split('.'))))" 2>/dev/null
}
find_python() {
  if [ -n "${PYTHON:-}" ]; then
    runs_version "$PYTHON" || die "PYTHON=$PYTHON is not a working Python $python_version (megatron-core $mcore needs it)"
    echo "$PYTHON"; return
  fi
  local candidate
  for candidate in "$(command -v "python$python_version" || true)" \
                   "$(command -v pyenv >/dev/null && echo "$(pyenv root)/versions/$python_version"*/bin/"python$python_version" | tr ' ' '\n' | sort -V | tail -n 1)"; do
    if runs_version "$candidate"; then echo "$candidate"; return; fi
  done
  die "Python $python_version not found (megatron-core $mcore needs it): install it (e.g. 'pyenv install $python_version') or point PYTHON at it"
}

say() { echo "setup_env.sh: $*"; }
step() {  # step "what (size, time)" command...: a line before, one every 10 s while it runs, one after
  local what=$1 start=$SECONDS status=0 ticker
  shift
  say "$what ..."
  ( while sleep 10; do say "  ... $((SECONDS - start)) s"; done ) &
  ticker=$!
  "$@" || status=$?
  kill "$ticker" 2>/dev/null; wait "$ticker" 2>/dev/null || true
  [ $status = 0 ] || die "${what%% (*} failed (exit status $status; its messages are above)"
  say "  done in $((SECONDS - start)) s"
}

wanted="megatron-core $mcore: ${packages[*]}"
stamp=$venv/.orch-installed
if [ -x "$venv/bin/python" ] && ! runs_version "$venv/bin/python"; then
  echo "setup_env.sh: $venv is not a Python $python_version venv: making it again" >&2
  rm -rf "$venv"
fi
if [ ! -x "$venv/bin/python" ]; then
  python="$(find_python)" || exit 1  # find_python's error is already printed
  say "setting up $venv for megatron-core $mcore (once; $setup_time, longer beside other work)"
  step "creating $venv with $python and upgrading pip (~15 s)" \
    bash -c '"$1" -m venv "$2" && "$2/bin/python" -m pip install -q --upgrade pip' _ "$python" "$venv"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ] || [ setup.py -nt "$stamp" ]; then
  # The exact versions first, so the package's ranges install nothing more (on Python 3.11 pip takes the
  # local CPU build of torch, instead of resolving a CUDA one).
  step "installing ${packages[*]} ($packages_size)" "$venv/bin/python" -m pip install -q "${packages[@]}"
  step "installing megatron-orch (editable) with its test and energon extras: numpy, numba, OR-Tools, pytest, \
hypothesis, ... (~30 s)" "$venv/bin/python" -m pip install -q -e '.[test,energon]'
  # numba caches the compiled kernels beside their sources (megatron_orch/balance/**/__pycache__), so the first
  # training run loads them in under a second instead of compiling them on every rank
  step "compiling the planning kernels (numba, cached for every later run; about a minute of CPU)" \
    "$venv/bin/python" -c "from megatron_orch.mllm.config import load_model_config
from megatron_orch.sim.cluster import warm_up_planner
warm_up_planner(load_model_config('tiny'))"
  echo "$wanted" > "$stamp"
  say "$venv ready (megatron-core $mcore)"
fi
