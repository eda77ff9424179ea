#!/usr/bin/env bash
# Build DeepGEMM at the pins of images/versions.yaml (deepgemm_commit, cutlass_commit, fmt_commit,
# deepgemm_patches), as a wheel, optionally install it, then smoke-check it through pithtrain's loader.
#
#   DEEPGEMM_COMMIT=... CUTLASS_COMMIT=... FMT_COMMIT=... DEEPGEMM_PATCHES="C1 C2 ..." TORCH_CUDA_ARCH_LIST=9.0a \
#     images/build_deepgemm.sh [--src DIR|TARBALL] [--wheel-dir DIR] [--target DIR | --install] [--check]
#
# Sources: --src a tarball from images/pack_deepgemm_src.sh (DeepGEMM/ with third-party/{cutlass,fmt}/include
# and a PINS file, checked against the env pins) or an unpacked tree; without --src, git fetches the three
# pinned commits (the image build) and checks that DeepGEMM's submodule entries are the cutlass/fmt pins.
# DEEPGEMM_PATCHES: upstream DeepGEMM commits whose diffs (`git diff C^ C`) are applied on top, in order
# (the tarball carries them as patches/C.diff; the git path fetches each C). Only the submodules'
# include/ trees are used. TORCH_CUDA_ARCH_LIST: 9.0a Hopper, 10.0a Blackwell.
# --target DIR: pip install --target (no venv needed); --install: into the running environment;
# neither: the wheel is left in --wheel-dir (the Dockerfiles install it in their runtime stage).
# --check: import + a tiny FP8 grouped GEMM through `python -m pithtrain.kernels.deepgemm` (needs a GPU
# and this repository next to the script; skipped with a message otherwise).
set -euo pipefail

SRC="" WHEEL_DIR="" TARGET="" INSTALL=0 CHECK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --src) SRC="$2"; shift 2 ;;
    --wheel-dir) WHEEL_DIR="$2"; shift 2 ;;
    --target) TARGET="$2"; shift 2 ;;
    --install) INSTALL=1; shift ;;
    --check) CHECK=1; shift ;;
    *) echo "build_deepgemm.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
: "${DEEPGEMM_COMMIT:?set DEEPGEMM_COMMIT (images/versions.yaml deepgemm_commit)}"
: "${CUTLASS_COMMIT:?set CUTLASS_COMMIT (images/versions.yaml cutlass_commit)}"
: "${FMT_COMMIT:?set FMT_COMMIT (images/versions.yaml fmt_commit)}"
: "${DEEPGEMM_PATCHES?set DEEPGEMM_PATCHES (images/versions.yaml deepgemm_patches; may be empty)}"
: "${TORCH_CUDA_ARCH_LIST:?set TORCH_CUDA_ARCH_LIST (9.0a Hopper, 10.0a Blackwell)}"
PYTHON="${PYTHON:-python3}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/deepgemm.XXXXXX")"
WHEEL_DIR="${WHEEL_DIR:-$WORK/wheels}"
PINS="deepgemm=$DEEPGEMM_COMMIT cutlass=$CUTLASS_COMMIT fmt=$FMT_COMMIT patches=${DEEPGEMM_PATCHES// /,}"
echo "build_deepgemm: pins $PINS arch $TORCH_CUDA_ARCH_LIST work $WORK"

# --- sources
fetch() {  # fetch REPO_URL COMMIT DIR: one commit, shallow
  git init -q "$3" && git -C "$3" fetch -q --depth 1 "$1" "$2" && git -C "$3" checkout -q FETCH_HEAD
}
if [ -z "$SRC" ]; then
  fetch https://github.com/deepseek-ai/DeepGEMM.git "$DEEPGEMM_COMMIT" "$WORK/DeepGEMM"
  for sub in cutlass:"$CUTLASS_COMMIT" fmt:"$FMT_COMMIT"; do
    name="${sub%%:*}" want="${sub#*:}"
    got="$(git -C "$WORK/DeepGEMM" ls-tree HEAD "third-party/$name" | awk '{print $3}')"
    [ "$got" = "$want" ] || { echo "build_deepgemm: DeepGEMM pins third-party/$name at $got, versions.yaml $want" >&2; exit 1; }
  done
  mkdir -p "$WORK/DeepGEMM/patches"
  for c in $DEEPGEMM_PATCHES; do  # C and its parent, for the diff
    git -C "$WORK/DeepGEMM" fetch -q --depth 2 https://github.com/deepseek-ai/DeepGEMM.git "$c"
    git -C "$WORK/DeepGEMM" diff "$c^" "$c" > "$WORK/DeepGEMM/patches/$c.diff"
  done
  fetch https://github.com/NVIDIA/cutlass.git "$CUTLASS_COMMIT" "$WORK/cutlass"
  fetch https://github.com/fmtlib/fmt.git "$FMT_COMMIT" "$WORK/fmt"
  for name in cutlass fmt; do
    rm -rf "$WORK/DeepGEMM/third-party/$name" && mkdir -p "$WORK/DeepGEMM/third-party/$name"
    cp -r "$WORK/$name/include" "$WORK/DeepGEMM/third-party/$name/"
  done
  SRC="$WORK/DeepGEMM"
elif [ -f "$SRC" ]; then
  tar -xzf "$SRC" -C "$WORK"
  SRC="$WORK/DeepGEMM"
else  # an unpacked tree: patched and stamped in a copy, so a second run starts from the same sources
  cp -r "$SRC" "$WORK/DeepGEMM"
  SRC="$WORK/DeepGEMM"
fi
if [ -f "$SRC/PINS" ] && [ "$(cat "$SRC/PINS")" != "$PINS" ]; then
  echo "build_deepgemm: $SRC/PINS is '$(cat "$SRC/PINS")', versions.yaml wants '$PINS'" >&2; exit 1
fi
apply_fix() {  # patch(1) where installed, else git apply (which works outside a repository too)
  if command -v patch >/dev/null; then patch -d "$SRC" -p1 --forward --fuzz=0 --quiet < "$1"; else (cd "$SRC" && git apply "$1"); fi
}
for c in $DEEPGEMM_PATCHES; do
  apply_fix "$SRC/patches/$c.diff" || { echo "build_deepgemm: upstream fix $c does not apply" >&2; exit 1; }
  echo "build_deepgemm: applied upstream fix $c"
done
# The build, stamped into the package's version (PEP 440 local label: the commit and each fix, 7
# hex digits each: <version>+<commit>.<fix>...): what `invoke doctor` reads from the installed
# distribution (tools/appliance.py deepgemm_build), not from an environment variable.
STAMP="$(printf %.7s "$DEEPGEMM_COMMIT")"
for c in $DEEPGEMM_PATCHES; do STAMP="$STAMP.$(printf %.7s "$c")"; done
sed -i -E "s/^(__version__ = ['\"])([0-9.]+)(['\"])/\1\2+$STAMP\3/" "$SRC/deep_gemm/__init__.py"
grep -q "^__version__ = .*+$STAMP" "$SRC/deep_gemm/__init__.py" \
  || { echo "build_deepgemm: could not stamp $STAMP into deep_gemm/__init__.py's __version__" >&2; exit 1; }
for d in cutlass/include/cute fmt/include/fmt; do
  [ -d "$SRC/third-party/$d" ] || { echo "build_deepgemm: $SRC/third-party/$d missing" >&2; exit 1; }
done

# --- build: DG_USE_LOCAL_VERSION=0 (no git needed in the tree), DG_FORCE_BUILD=1 (no attempt to
# download a prebuilt wheel: the image build and the device have no route to it).
mkdir -p "$WHEEL_DIR"
rm -f "$WHEEL_DIR"/deep_gemm-*.whl  # a reused directory: only this build's wheel is installed below
start=$SECONDS
(cd "$SRC" && DG_USE_LOCAL_VERSION=0 DG_FORCE_BUILD=1 MAX_JOBS="${MAX_JOBS:-8}" \
  "$PYTHON" -m pip wheel --no-build-isolation --no-deps -w "$WHEEL_DIR" .)
wheel="$(ls "$WHEEL_DIR"/deep_gemm-*.whl)"  # fails the script when pip made none
echo "build_deepgemm: wheel built in $((SECONDS - start)) s: $wheel"
if [ -n "$TARGET" ]; then
  "$PYTHON" -m pip install -q --no-deps --no-index --target "$TARGET" "$WHEEL_DIR"/deep_gemm-*.whl
  export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
elif [ "$INSTALL" = 1 ]; then
  "$PYTHON" -m pip install -q --no-deps --no-index "$WHEEL_DIR"/deep_gemm-*.whl
fi

# --- smoke check through pithtrain's loader (libstdc++ fix included)
if [ "$CHECK" = 1 ]; then
  if [ -f "$REPO/pithtrain/kernels/deepgemm.py" ] && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m pithtrain.kernels.deepgemm
  else
    echo "build_deepgemm: smoke check skipped (needs a GPU and pithtrain next to this script)"
  fi
fi
