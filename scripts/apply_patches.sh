#!/usr/bin/env bash
# Apply megatron-orch's patch for the Megatron-LM release a checkout holds.
#
#   scripts/apply_patches.sh MEGATRON_LM_DIR
#
# The release is read off the tree's own files, not its git history: every file a patch touches is
# identified by its blob hash (`git hash-object`) against each patches/core_v*/ folder's `index` lines.
# A folder fits when each such file is its pre-image (unpatched) or its post-image (patched), so a fork
# with unrelated commits, or a plain copy without .git, takes the patch of the release its files came
# from; in a git checkout whose HEAD is not that release's tag commit, a note says so. A file that fits
# no folder (a changed training.py, Megatron-LM main) is refused, naming the file and its blob, before
# anything is written; pretrain_mllm.py then installs the same hook at run time, without a patch.
# Per patch: already applied (`git apply --reverse --check`) -> says so and leaves it; else
# `git apply --check`, then `git apply`. Idempotent: a second run reports the patch as applied, exit 0.
set -euo pipefail

PATCHES="$(cd "$(dirname "$0")/../patches" && pwd)"

die() { echo "apply_patches.sh: error: $*" >&2; exit 1; }
note() { echo "apply_patches.sh: $*"; }

case "${1:-}" in
  -h|--help) sed -n '2,14s/^# \{0,1\}//p' "$0"; exit 0 ;;
esac
[ $# -eq 1 ] || die "usage: scripts/apply_patches.sh MEGATRON_LM_DIR (a Megatron-LM checkout of a supported release; --help)"
[ -d "$1" ] || die "$1 is not a directory"
target="$(cd "$1" && pwd -P)"
[ -f "$target/megatron/training/training.py" ] || \
  die "$target is not a Megatron-LM checkout (no megatron/training/training.py)"

# git runs inside the target only: never in the work tree of a repository around it (inside another work
# tree, git apply skips paths outside the current directory, prints "Skipped patch" and exits 0).
in_target() { (cd "$target" && unset GIT_DIR GIT_WORK_TREE && GIT_CEILING_DIRECTORIES="$(dirname "$target")" "$@"); }
# "path pre-image-blob post-image-blob" of each file a patch changes
touched() { awk '/^diff --git /{path=substr($3, 3)} /^index /{split($2, h, /\.\./); print path, h[1], h[2]}' "$1"; }

shopt -s nullglob
releases=()
match=""
for folder in "$PATCHES"/core_v*/; do
  release="$(basename "$folder")"
  releases+=("$release")
  patches=("$folder"*.patch)
  [ ${#patches[@]} -gt 0 ] || die "no patches in $folder"
  fits=1
  for patch in "${patches[@]}"; do
    while read -r path pre post; do
      found="$( [ -f "$target/$path" ] && git hash-object "$target/$path" || echo missing)"
      [ "$found" = "$pre" ] || [ "$found" = "$post" ] || fits=0
    done < <(touched "$patch")
  done
  if [ $fits = 1 ]; then match=$release; break; fi
done
if [ -z "$match" ]; then
  base="$target/megatron/training/training.py"
  die "$base (blob $(git hash-object "$base")) is neither the file of a supported Megatron-LM release \
(${releases[*]}) nor its patched version, so no patch is made for it (local changes, or a newer Megatron-LM); \
without a patch pretrain_mllm.py installs the same schedule hook at run time"
fi
folder="$PATCHES/$match"
# the tag commits whose files the patch was made against: "(commit X)" and "Also for TAG (commit Y)" lines
commits="$(sed -n '/^diff --git/q; s/.*(commit \([0-9a-f]\{40\}\)).*/\1/p' "$folder"/*.patch)"

if [ -e "$target/.git" ] && head="$(in_target git rev-parse HEAD 2>/dev/null)"; then
  if grep -qx "$head" <<< "$commits"; then
    note "$target is a git checkout of a Megatron-LM release tag that $match's patch was made for (commit $head)"
  else
    note "$target is a git checkout at $head, not at the commit of $match (or a release with the same files); its patched files are $match's (by blob hash), so $match's patch applies (a fork or branch with other changes)"
  fi
else
  note "$target holds Megatron-LM $match's files (checked by blob hash)"
fi

for patch in "$folder"/*.patch; do
  name="$match/$(basename "$patch")"
  if in_target git apply --reverse --check "$patch" 2>/dev/null; then
    note "$name is already applied; left as is"
    continue
  fi
  check_log="$(in_target git apply --check "$patch" 2>&1)" || die "$name does not apply to $target:
$check_log"
  in_target git apply "$patch"
  note "applied $name"
done
