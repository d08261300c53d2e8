#!/usr/bin/env bash
# Download, here, the wheels the GPU machine lacks (Python 3.12, x86-64, no network there): megatron-core 0.19.2
# and OR-Tools with the requirements its image does not hold. scripts/gpu_check.sh installs them from
# .whl/ when megatron.core does not import. The folder is git-ignored; carry it to the device.
#   bash scripts/fetch_device_wheels.sh [DIR]      (default: .whl in the repository; DIR relative to the
#                                                   current folder; --help prints this)
set -euo pipefail
source "$(dirname "$0")/cli.sh"
dir=
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    -*) die "unknown option $1 (usage: bash scripts/$script_name [DIR])" ;;
    *) [ -z "$dir" ] || die "one DIR only, got '$dir' and '$1'"; dir=$(abspath "$1") ;;
  esac
  shift
done
cd "$(dirname "$0")/.."
dir=${dir:-$PWD/.whl}
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$dir" \
  megatron-core==0.19.2 ortools==9.15.6755 'protobuf>=6.33.1,<6.34' immutabledict==4.2.1
ls -la "$dir"
