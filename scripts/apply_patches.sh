#!/usr/bin/env bash
# Apply megatron-orch's patches (patches/core_v0.16.1/*.patch) to a Megatron-LM checkout at tag core_v0.16.1.
#
#   scripts/apply_patches.sh MEGATRON_LM_DIR
#
# Checks the checkout first: a git checkout must have the tag's commit checked out; a plain copy (no .git)
# must hold the files the patches were made against (their blob hashes, from each patch's `index` lines).
# Then, per patch: already applied (`git apply --reverse --check` passes) -> says so and leaves it; else
# `git apply --check`, then `git apply`. Any mismatch is refused with a message and exit status 1, before
# anything is written. Idempotent: a second run reports every patch as already applied and exits 0.
set -euo pipefail

TAG=core_v0.16.1
COMMIT=55ac7082517c3878ae653c07c09c534b8aed49f6
PATCH_DIR="$(cd "$(dirname "$0")/../patches/$TAG" && pwd)"

die() { echo "apply_patches.sh: error: $*" >&2; exit 1; }

[ $# -eq 1 ] || die "usage: scripts/apply_patches.sh MEGATRON_LM_DIR (a Megatron-LM checkout at tag $TAG)"
[ -d "$1" ] || die "$1 is not a directory"
target="$(cd "$1" && pwd -P)"
[ -f "$target/megatron/training/training.py" ] || \
  die "$target is not a Megatron-LM checkout (no megatron/training/training.py)"
shopt -s nullglob
patches=("$PATCH_DIR"/*.patch)
[ ${#patches[@]} -gt 0 ] || die "no patches in $PATCH_DIR"

# git runs inside the target only: never in the work tree of a repository around it (inside another work
# tree, git apply skips paths outside the current directory, prints "Skipped patch" and exits 0).
in_target() { (cd "$target" && unset GIT_DIR GIT_WORK_TREE && GIT_CEILING_DIRECTORIES="$(dirname "$target")" "$@"); }

if [ -e "$target/.git" ]; then
  head="$(in_target git rev-parse HEAD)" || die "$target: git rev-parse HEAD failed"
  [ "$head" = "$COMMIT" ] || die "$target is a git checkout at commit $head, not Megatron-LM $TAG ($COMMIT); \
check out the tag first: git -C '$target' checkout $TAG"
  echo "apply_patches.sh: $target is Megatron-LM $TAG (git commit $COMMIT)"
else
  # No git metadata: identify the tree by the blob hash of every file the patches touch; each must be
  # the pre-image of its patch (unpatched) or its post-image (patched).
  for patch in "${patches[@]}"; do
    while read -r path pre post; do
      [ -f "$target/$path" ] || die "$target has no $path, which $(basename "$patch") patches"
      found="$(git hash-object "$target/$path")"
      if [ "$found" != "$pre" ] && [ "$found" != "$post" ]; then
        die "$target/$path (blob $found) is neither the $TAG file (blob $pre) nor its patched version \
(blob $post): the checkout is not Megatron-LM $TAG"
      fi
    done < <(awk '/^diff --git /{path=substr($3, 3)} /^index /{split($2, h, /\.\./); print path, h[1], h[2]}' "$patch")
  done
  echo "apply_patches.sh: $target holds Megatron-LM $TAG's files (no .git: checked by blob hashes)"
fi

for patch in "${patches[@]}"; do
  name="$(basename "$patch")"
  if in_target git apply --reverse --check "$patch" 2>/dev/null; then
    echo "apply_patches.sh: $name is already applied; left as is"
    continue
  fi
  check_log="$(in_target git apply --check "$patch" 2>&1)" || \
    die "$name does not apply to $target (it was made for Megatron-LM $TAG; local changes?):
$check_log"
  in_target git apply "$patch"
  echo "apply_patches.sh: applied $name"
done
