#!/usr/bin/env bash
# Issue #22 on the lent H200, in one call (under 420 s): build DeepGEMM from the carried tarball (its
# wheel left in $OUT/wheel), import it through pithtrain's loader, probe the k-grouped GEMM, run its
# GPU tests, time the expert GEMMs piece by piece. Logs in $OUT.
#
#   scripts/pack_deepgemm_src.sh          # here, once: .carry/deepgemm-src.tar.gz
#   run(command="bash scripts/device22.sh", carry=[".carry"], timeout_s=450)
#
# Each stage reports its own status; later stages still run where they can (a failed build skips
# the DeepGEMM stages; the bench still times torch and Triton).
set -uo pipefail
OUT="${OUT:-/tmp/out22}"; mkdir -p "$OUT"
export PS4='+ [${SECONDS}s] ' PYTHONUNBUFFERED=1 DG_JIT_CACHE_DIR=/tmp/dg-cache TRITON_CACHE_DIR=/tmp/triton-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
REPO="$(cd "$(dirname "$0")/.." && pwd)"; cd "$REPO"
stage() { echo; echo "=== [${SECONDS}s] $1"; }
main() {
declare -A STATUS
set -x
nvidia-smi -L; python3 -c 'import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)'
which nvcc && nvcc --version | tail -1

stage "1 build DeepGEMM (TORCH_CUDA_ARCH_LIST=9.0a) into /tmp/dg-site"
eval "$(python3 -c "
from tools.appliance import load_versions
p = load_versions()['targets']['hopper']
print(f\"export DEEPGEMM_COMMIT={p['deepgemm_commit']} CUTLASS_COMMIT={p['cutlass_commit']} FMT_COMMIT={p['fmt_commit']}\")
print(f\"export DEEPGEMM_PATCHES='{p['deepgemm_patches']}'\")")"
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 timeout 240 images/build_deepgemm.sh \
  --src .carry/deepgemm-src.tar.gz --target /tmp/dg-site --wheel-dir "$OUT/wheel" > "$OUT/build.log" 2>&1
STATUS[build]=$?; tail -5 "$OUT/build.log"
export PYTHONPATH="$REPO:/tmp/dg-site"

stage "2 import through pithtrain's loader (libstdc++ promoted RTLD_GLOBAL), then the smoke GEMM"
if [ "${STATUS[build]}" = 0 ]; then
  timeout 120 python3 -m pithtrain.kernels.deepgemm; STATUS[import]=$?
  if [ "${STATUS[import]}" != 0 ]; then  # diagnose: does the old LD_PRELOAD work where the loader did not?
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6 timeout 120 python3 -m pithtrain.kernels.deepgemm
    STATUS[import_ld_preload]=$?
    [ "${STATUS[import_ld_preload]}" = 0 ] && export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6
  fi
else
  STATUS[import]=skipped
fi

stage "3 k-grouped probe (DeepGEMM's own generator, then the wrapper) and pytest -m gpu tests/test_deepgemm_gpu.py"
mkdir -p /tmp/dgsrc && tar -xzf .carry/deepgemm-src.tar.gz -C /tmp/dgsrc
timeout 120 python3 scripts/deepgemm_kgrouped_probe.py > "$OUT/probe.log" 2>&1
STATUS[probe]=$?; cat "$OUT/probe.log"
timeout 150 python3 -m pytest -p no:cacheprovider -q -m gpu -rs tests/test_deepgemm_gpu.py > "$OUT/pytest.log" 2>&1
STATUS[pytest]=$?; tail -25 "$OUT/pytest.log"

stage "4 where the time goes (scripts/deepgemm_parts.py)"
timeout 150 python3 scripts/deepgemm_parts.py > "$OUT/parts.log" 2>&1
STATUS[parts]=$?
set +x
stage "summary"
for k in "${!STATUS[@]}"; do echo "  $k: ${STATUS[$k]}"; done
echo "--- parts"; cat "$OUT/parts.log"
}
main 2>&1 | tee "$OUT/device22.log"  # a pipeline: bash waits for tee (no lost tail)
