# Sourced by the scripts for their command lines, before they change folder: `usage` prints the calling
# script's header comment (its help); `die MESSAGE` prints "SCRIPT: error: MESSAGE" and exits with
# status 2, as argparse does; `abspath PATH` resolves PATH against the caller's folder.
script_name=$(basename "$0")
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "$script_name: error: $*" >&2; exit 2; }
abspath() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
# device_options ARGS...: the device scripts' command line, OUT_DIR [--cpu] [--help] in any order; sets
# $out (absolute) and $mode (gpu, or cpu with --cpu). Anything else is refused before a step runs.
device_options() {
  out= mode=gpu
  while [ $# -gt 0 ]; do
    case $1 in
      -h|--help) usage; exit 0 ;;
      --cpu) mode=cpu ;;
      -*) die "unknown option $1 (usage: bash scripts/$script_name [--cpu] OUT_DIR; --help for more)" ;;
      *) [ -z "$out" ] || die "one OUT_DIR only, got '$out' and '$1'"; out=$1 ;;
    esac
    shift
  done
  [ -n "$out" ] || die "OUT_DIR is missing (usage: bash scripts/$script_name [--cpu] OUT_DIR; --help for more)"
  out=$(abspath "$out")
}
