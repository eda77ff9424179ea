#!/usr/bin/env bash
# One device call: the GPU half of the test suite and the runs that need CUDA. Full logs under $OUT,
# a short summary last. On a 2-GPU machine it also runs every parallel layout against one GPU.
#   OUT=/tmp/out bash scripts/gpu_check.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/pithtrain-out}; mkdir -p "$OUT"
ngpu=$(nvidia-smi -L | wc -l)
{ nvidia-smi -L; git log -1 --format='commit %h %s' 2>/dev/null; } | tee "$OUT/env.txt"
timeout 120 python3 -m invoke train --runtime=native --set log.run_dir=/tmp/quickstart \
  > "$OUT/train-native.txt" 2>&1; echo "invoke train --runtime=native rc=$?"
grep -E "^pithtrain|^step +(25|300) " "$OUT/train-native.txt"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -m gpu -p no:cacheprovider -q -rfE tests \
  > "$OUT/gpu-tests.txt" 2>&1; echo "pytest -m gpu rc=$?"
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu-tests.txt" | tail -12
if [ "$ngpu" -ge 2 ]; then
  timeout "${PARITY_TIMEOUT:-300}" python3 scripts/multi_gpu_parity.py --nproc 2 --out "$OUT/parity" --runs /tmp/parity-runs \
    > "$OUT/parity.txt" 2>&1; echo "multi_gpu_parity rc=$?"; tail -12 "$OUT/parity.txt"
fi
