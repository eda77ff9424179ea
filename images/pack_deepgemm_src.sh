#!/usr/bin/env bash
# Pack DeepGEMM's source at the versions.yaml pins into .carry/deepgemm-src.tar.gz (a few MB), for
# hosts with no route to GitHub (the lent device): DeepGEMM/ (git archive of deepgemm_commit) with
# third-party/cutlass/include and third-party/fmt/include (git archives of the submodule pins),
# patches/C.diff for each upstream fix C of deepgemm_patches (`git diff C^ C`) and a PINS file that
# images/build_deepgemm.sh checks.
#
#   images/pack_deepgemm_src.sh [DEEPGEMM_GIT CUTLASS_GIT FMT_GIT]   # git dirs holding the commits
#
# Checks first: deepgemm_tag names deepgemm_commit, and the commit's submodule entries
# (git ls-tree third-party/) are cutlass_commit and fmt_commit.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DG="${1:-/work/.mirror/deepseek-ai+DeepGEMM/repo}"
CUTLASS="${2:-/work/.mirror/NVIDIA+cutlass/repo}"
FMT="${3:-/work/.mirror/fmtlib+fmt/repo}"
read -r TAG COMMIT CUTLASS_COMMIT FMT_COMMIT PATCHES < <(cd "$REPO" && python3 -c "
from tools.appliance import load_versions
p = load_versions()['targets']['hopper']
print(p['deepgemm_tag'], p['deepgemm_commit'], p['cutlass_commit'], p['fmt_commit'], p['deepgemm_patches'])")

tagged="$(git -C "$DG" rev-parse "$TAG^{commit}")"
[ "$tagged" = "$COMMIT" ] || { echo "pack: tag $TAG is $tagged, versions.yaml deepgemm_commit $COMMIT" >&2; exit 1; }
for sub in cutlass:"$CUTLASS_COMMIT" fmt:"$FMT_COMMIT"; do
  name="${sub%%:*}" want="${sub#*:}"
  got="$(git -C "$DG" ls-tree "$COMMIT" "third-party/$name" | awk '{print $3}')"
  [ "$got" = "$want" ] || { echo "pack: $TAG pins third-party/$name at $got, versions.yaml $want" >&2; exit 1; }
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
git -C "$DG" archive --prefix=DeepGEMM/ "$COMMIT" | tar -x -C "$tmp"
git -C "$CUTLASS" archive --prefix=DeepGEMM/third-party/cutlass/ "$CUTLASS_COMMIT" include | tar -x -C "$tmp"
git -C "$FMT" archive --prefix=DeepGEMM/third-party/fmt/ "$FMT_COMMIT" include | tar -x -C "$tmp"
mkdir -p "$tmp/DeepGEMM/patches"
for c in $PATCHES; do git -C "$DG" diff "$c^" "$c" > "$tmp/DeepGEMM/patches/$c.diff"; done
echo "deepgemm=$COMMIT cutlass=$CUTLASS_COMMIT fmt=$FMT_COMMIT patches=${PATCHES// /,}" > "$tmp/DeepGEMM/PINS"
mkdir -p "$REPO/.carry"
tar -czf "$REPO/.carry/deepgemm-src.tar.gz" -C "$tmp" DeepGEMM
echo "pack: $TAG ($COMMIT) + fixes $PATCHES + cutlass $CUTLASS_COMMIT + fmt $FMT_COMMIT include/ ->" \
  "$(du -h "$REPO/.carry/deepgemm-src.tar.gz" | cut -f1) .carry/deepgemm-src.tar.gz"
