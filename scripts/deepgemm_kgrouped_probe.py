"""Issue #22: DeepGEMM's k-grouped FP8 GEMM (the experts' weight gradient) on the bench's shapes, with
DeepGEMM's own generator and reference (tests/generators.py: generate_k_grouped_contiguous), one case
per process (an illegal instruction poisons the CUDA context). Which parameter breaks: groups, m, n?
On the device, after images/build_deepgemm.sh --target /tmp/dg-site and unpacking the carried source
tarball (scripts/pack_deepgemm_src.sh) into /tmp/dgsrc:

    PYTHONPATH=$PWD:/tmp/dg-site python3 scripts/deepgemm_kgrouped_probe.py

Outcome on the H200, 2026-12-02: docs/perf-notes.md (DeepGEMM section, call 20). The second half runs
the same data through both DeepGEMM's own operand path (per_channel_cast_to_fp8, the generator's
transposed blocks) and pithtrain's wrapper (deepgemm.plan / pad / kgrouped_fp8_wgrad), on the GPU
test's pattern (few rows per expert, every 7th expert empty, the first included), and compares the
operands tensor by tensor: which of the two makes the 0.167 error."""
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
    tail = run(CASE.format(G=G, m=m, n=n, kpg=kpg, empty=empty), 90)
    print(f"groups {G:3d} m {m:5d} n {n:5d} rows/group {kpg:5d} empty {int(empty)}: {tail}", flush=True)


PAIR = r'''
import sys, torch
sys.path.insert(0, "/tmp/dgsrc/DeepGEMM/tests")
from pithtrain.kernels import deepgemm, fp8
from deep_gemm.utils.math import per_channel_cast_to_fp8
from deep_gemm.testing.numeric import calc_diff
dg = deepgemm.load()
E, m, n, rows = {E}, {m}, {n}, {rows}
g = torch.Generator(device="cuda").manual_seed(0)
counts = torch.randint(0, 2 * rows, (E,), generator=g, device="cuda")
if {every7}: counts[::7] = 0
offs = counts.cumsum(0).int()
M = int(offs[-1])
x = torch.randn(M, m, device="cuda", dtype=torch.bfloat16, generator=g)
dy = torch.randn(M, n, device="cuda", dtype=torch.bfloat16, generator=g)
p = deepgemm.plan(offs, M)
xp, dyp = deepgemm.pad(x, p), deepgemm.pad(dy, p)
ref = torch.zeros(E, m, n, device="cuda")
s0 = 0
for e, k in enumerate(p.ks):
    ref[e] = xp[s0:s0 + k].float().T @ dyp[s0:s0 + k].float()
    s0 += k
def theirs(t):  # DeepGEMM's generator: 128 x 1 scales, each group's block transposed (K-major)
    q, sf = per_channel_cast_to_fp8(t, use_ue8m0=False)
    flat, s0 = torch.empty(q.numel(), dtype=q.dtype, device="cuda"), 0
    for k in p.ks:
        flat[s0 * t.shape[1]:(s0 + k) * t.shape[1]] = q[s0:s0 + k].T.flatten()
        s0 += k
    return flat, sf
(qa, sa), (qb, sb) = theirs(xp), theirs(dyp)
d1 = torch.zeros_like(ref)
dg.k_grouped_fp8_gemm_nt_contiguous((qa, sa.T), (qb, sb.T), d1, p.ks, p.ks_tensor, d1)
d2 = deepgemm.kgrouped_fp8_wgrad(dg, xp, dyp, p)
ours = fp8.quant_tokens(xp, p.tile_start, p.tile_len, transpose=True, ue8m0=False)
torch.cuda.synchronize()
live = sa > 1e-4 / 448 * 1.0001  # blocks holding a nonzero value (DeepGEMM clamps amax at 1e-4, we at 1e-30)
print(f"theirs {{calc_diff(d1, ref):.2e}} ours {{calc_diff(d2, ref):.2e}} | x codes equal "
      f"{{(ours[0].view(torch.uint8) == qa.view(torch.uint8)).float().mean().item():.4f}}, scales max rel diff "
      f"{{((ours[1] - sa).abs() / sa)[live].max().item():.2e}}, scale shapes {{tuple(ours[1].shape)}} {{tuple(sa.shape)}}, "
      f"empty groups {{sum(k == 0 for k in p.ks)}}, first ks {{p.ks[:4]}}")
'''

pairs = [  # (experts, m, n, mean rows per expert, every 7th expert empty)
    (128, 2048, 1536, 64, True),    # the GPU test's Qwen3 w13 case
    (128, 2048, 1536, 64, False),
    (128, 2048, 1536, 512, False),  # the probe's passing size through the wrapper
    (64, 2048, 2816, 64, True),     # DeepSeek w13, the GPU test's pattern
]
for E, m, n, rows, every7 in pairs:
    tail = run(PAIR.format(E=E, m=m, n=n, rows=rows, every7=every7), 120)
    print(f"pair: experts {E:3d} m {m:5d} n {n:5d} rows/expert ~{rows:4d} every7th empty {int(every7)}: {tail}",
          flush=True)
