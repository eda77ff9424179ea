"""Issue #22: DeepGEMM's k-grouped FP8 GEMM (the experts' weight gradient) on the bench's shapes, with
DeepGEMM's own generator and reference (tests/generators.py: generate_k_grouped_contiguous), one case
per process (an illegal instruction poisons the CUDA context). Which parameter breaks: groups, m, n?
On the device, after images/build_deepgemm.sh --target /tmp/dg-site and unpacking the carried source
tarball (scripts/pack_deepgemm_src.sh) into /tmp/dgsrc:

    PYTHONPATH=$PWD:/tmp/dg-site python3 scripts/deepgemm_kgrouped_probe.py

Outcomes on the H200: docs/perf-notes.md (DeepGEMM section, calls 20 and 21; call 21 with the upstream
fixes of versions.yaml's deepgemm_patches). The second half builds
the operands DeepGEMM's own way (per_channel_cast_to_fp8, the generator's transposed blocks) on the
GPU test's pattern (0-127 rows per expert, so 128 padded rows per group, every 7th expert empty)
and at ~512 rows per expert: is the GEMM itself wrong at one K block per group?"""
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
    (128, 768, 2048, 512, True),    # Qwen3 w2 (D x N of dw2): fewer output tiles than SMs
]


def run(code: str, timeout: int) -> str:
    """One case in its own interpreter: its last output line, or how it failed."""
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout"
    if r.returncode == 0:
        return (r.stdout.strip().splitlines() or [""])[-1]
    return f"rc {r.returncode}: " + " | ".join((r.stderr.strip().splitlines() or ["?"])[-2:])[:300]


for G, m, n, kpg, empty in cases:
    tail = run(CASE.format(G=G, m=m, n=n, kpg=kpg, empty=empty), 35)
    print(f"groups {G:3d} m {m:5d} n {n:5d} rows/group {kpg:5d} empty {int(empty)}: {tail}", flush=True)


PAIR = r'''
import sys, torch
sys.path.insert(0, "/tmp/dgsrc/DeepGEMM/tests")
from pithtrain.kernels import deepgemm
dg = deepgemm.load()  # first: the libstdc++ promotion must precede any import of deep_gemm
from deep_gemm.utils.math import per_channel_cast_to_fp8
from deep_gemm.testing.numeric import calc_diff
E, m, n, rows = {E}, {m}, {n}, {rows}
g = torch.Generator(device="cuda").manual_seed(0)
counts = torch.randint(0, 2 * rows, (E,), generator=g, device="cuda")
if {every7}: counts[::7] = 0
ks = [-(-c // 128) * 128 for c in counts.tolist()]
Mp = sum(ks)
x = torch.randn(Mp, m, device="cuda", dtype=torch.bfloat16, generator=g)
dy = torch.randn(Mp, n, device="cuda", dtype=torch.bfloat16, generator=g)
s0 = 0
for c, k in zip(counts.tolist(), ks):  # zero padding rows, as a padded layout has
    x[s0 + c:s0 + k] = 0
    dy[s0 + c:s0 + k] = 0
    s0 += k
ref = torch.zeros(E, m, n, device="cuda")
s0 = 0
for e, k in enumerate(ks):
    ref[e] = x[s0:s0 + k].float().T @ dy[s0:s0 + k].float()
    s0 += k
def theirs(t):  # DeepGEMM's generator: 128 x 1 scales, each group's block transposed (K-major)
    q, sf = per_channel_cast_to_fp8(t, use_ue8m0=False)
    flat, s0 = torch.empty(q.numel(), dtype=q.dtype, device="cuda"), 0
    for k in ks:
        flat[s0 * t.shape[1]:(s0 + k) * t.shape[1]] = q[s0:s0 + k].T.flatten()
        s0 += k
    return flat, sf
(qa, sa), (qb, sb) = theirs(x), theirs(dy)
d = torch.zeros_like(ref)
dg.k_grouped_fp8_gemm_nt_contiguous((qa, sa.T), (qb, sb.T), d, ks, torch.tensor(ks, device="cuda", dtype=torch.int32), d)
torch.cuda.synchronize()
print(f"diff {{calc_diff(d, ref):.2e}}, rows per group {{min(ks)}}-{{max(ks)}}, empty groups {{ks.count(0)}}")
'''

pairs = [  # (experts, m, n, mean rows per expert, every 7th expert empty)
    (128, 2048, 1536, 64, True),    # the GPU test's Qwen3 w13 case (wrong through the old wrapper)
    (128, 2048, 1536, 64, False),
    (64, 2048, 2816, 64, True),     # DeepSeek w13 (right through the old wrapper)
    (128, 2048, 1536, 512, True),
]
for E, m, n, rows, every7 in pairs:
    tail = run(PAIR.format(E=E, m=m, n=n, rows=rows, every7=every7), 40)
    print(f"pair: experts {E:3d} m {m:5d} n {n:5d} rows/expert ~{rows:4d} every7th empty {int(every7)}: {tail}",
          flush=True)
