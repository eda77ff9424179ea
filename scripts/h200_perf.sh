#!/usr/bin/env bash
# One device call (the lent H200): the bench for each "model=variants" argument and the GPU kernel
# tests where the argument "tests" stands; full logs under $OUT, a short table last. Example:
#   BENCH_ARGS="--layers 4" bash scripts/h200_perf.sh "qwen3-30b-a3b=ref,fused+compile" tests "gpt-oss-20b=fused+compile"
# Env: PROFILE=1 appends torch.profiler tables to $OUT/profile.txt; BENCH_TIMEOUT, TEST_TIMEOUT (s);
# BENCH_ARGS: extra arguments for every bench run (e.g. "--grad-accum 4 --steps 8").
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # carried wheels (/tmp/site) stay on the path
OUT=${OUT:-/tmp/pithtrain-out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,memory.used --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'cudnn', torch.backends.cudnn.version())"
  git log -1 --format='commit %h %s' 2>/dev/null; git status --short 2>/dev/null | head -30; } > "$OUT/env.txt" 2>&1
head -4 "$OUT/env.txt"
prof=(); [ "${PROFILE:-0}" = 1 ] && prof=(--profile "$OUT/profile.txt")
i=0
for spec in "$@"; do
  if [ "$spec" = tests ]; then
    timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -p no:cacheprovider -q -rfE \
      tests/test_kernels_gpu.py > "$OUT/gpu-tests.txt" 2>&1
    echo "gpu tests rc=$?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu-tests.txt" | tail -12
    continue
  fi
  i=$((i + 1)); model=${spec%%=*}; variants=${spec#*=}
  timeout "${BENCH_TIMEOUT:-400}" python3 -m pithtrain.bench --models "$model" --variants "$variants" \
    --json "$OUT/bench$i.json" "${prof[@]}" ${BENCH_ARGS:-} >> "$OUT/bench.txt" 2>&1
  echo "bench $model rc=$?"
done
grep -E "^bench: .*(tok/s|FAILED)|^\| " "$OUT/bench.txt" | tail -30
