"""Issue #22: DeepGEMM's k-grouped FP8 GEMM (the experts' weight gradient) on the bench's shapes, with
DeepGEMM's own generator and reference (tests/generators.py: generate_k_grouped_contiguous), one case
per process (an illegal instruction poisons the CUDA context). Which parameter breaks: groups, m, n?
On the device, after images/build_deepgemm.sh --target /tmp/dg-site and unpacking the carried source
tarball (scripts/pack_deepgemm_src.sh) into /tmp/dgsrc:

    PYTHONPATH=$PWD:/tmp/dg-site python3 scripts/deepgemm_kgrouped_probe.py

Outcome on the H200, 2026-12-02: docs/perf-notes.md (DeepGEMM section, call 20)."""
import os
import subprocess
import sys

CASE = r'''
import random, sys, torch
sys.path.insert(0, "/tmp/dgsrc/DeepGEMM/tests")
from pithtrain.kernels.deepgemm import load
why = []
dg = load(why)
assert dg is not None, why
from generators import generate_k_grouped_contiguous, MajorTypeAB
from deep_gemm.testing.numeric import calc_diff
G, m, n, kpg = {G}, {m}, {n}, {kpg}
random.seed(0); torch.manual_seed(0)
ks = [kpg] * G
if {empty}: ks[1] = 0
k, a, b, c, d, ref = generate_k_grouped_contiguous(G, m, n, MajorTypeAB.KMajor, MajorTypeAB.KMajor, ks, use_ue8m0=False)
dg.k_grouped_fp8_gemm_nt_contiguous(a, b, d, ks, torch.tensor(ks, dtype=torch.int, device="cuda"), c)
torch.cuda.synchronize()
print(f"diff {{calc_diff(d, ref):.2e}}")
'''

cases = [  # (groups, m, n, rows per group, one empty group)
    (4, 4096, 7168, 8192, False),   # DeepGEMM's own first case (sanity)
    (4, 4096, 7168, 512, False),    # fewer rows per group
    (128, 4096, 7168, 512, False),  # 128 groups
    (128, 768, 2048, 512, False),   # Qwen3 w2 (D x N of dw2)
    (128, 2048, 1536, 512, False),  # Qwen3 w13
    (64, 2048, 2816, 768, False),   # DeepSeek w13
    (64, 1408, 2048, 768, False),   # DeepSeek w2
]
for G, m, n, kpg, empty in cases:
    code = CASE.format(G=G, m=m, n=n, kpg=kpg, empty=empty)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
        tail = (r.stdout.strip().splitlines() or [""])[-1] if r.returncode == 0 else \
            f"rc {r.returncode}: " + " | ".join((r.stderr.strip().splitlines() or ["?"])[-2:])[:300]
    except subprocess.TimeoutExpired:
        tail = "timeout"
    print(f"groups {G:3d} m {m:5d} n {n:5d} rows/group {kpg:5d} empty {int(empty)}: {tail}", flush=True)
