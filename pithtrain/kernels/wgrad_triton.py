"""The k-grouped GEMM adding into its output, in Triton: grad[e] += x[rows of e]^T dy[rows of e].

Used by kernels/wgrad.py on CUDA (the expert weight gradients of micro-batches 2 and later, added
straight into the gradient they accumulate); the reference is torch's F.grouped_mm then add_
(tests/test_kernels_gpu.py; scripts/wgrad_probe.py times tile configurations).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _wgrad_accum_kernel(x_ptr, dy_ptr, c_ptr, offs_ptr, D, N, sx, sdy, sc_e, sc_d,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """c[e, m-tile, n-tile] += x[rows of e, m-tile]^T @ dy[rows of e, n-tile]; one program per
    output tile, the experts on grid axis 1 (so one expert's rows stay in L2 for its tiles)."""
    e = tl.program_id(1)
    num_n = tl.cdiv(N, BN)
    pm, pn = tl.program_id(0) // num_n, tl.program_id(0) % num_n
    start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0).to(tl.int64)
    end = tl.load(offs_ptr + e).to(tl.int64)
    if end > start:  # an expert without rows leaves its gradient as it is
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(start, end, BK):
            rows = k + rk
            in_k = rows < end
            a = tl.load(x_ptr + rows[:, None] * sx + rm[None, :], mask=in_k[:, None] & (rm < D)[None, :], other=0.0)
            b = tl.load(dy_ptr + rows[:, None] * sdy + rn[None, :], mask=in_k[:, None] & (rn < N)[None, :],
                        other=0.0)
            acc = tl.dot(tl.trans(a), b, acc)
        c_ptrs = c_ptr + e.to(tl.int64) * sc_e + rm[:, None] * sc_d + rn[None, :]
        c_mask = (rm < D)[:, None] & (rn < N)[None, :]
        c = tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
        tl.store(c_ptrs, (c + acc).to(c_ptr.dtype.element_ty), mask=c_mask)


# Tiles: the fastest of 11 configurations summed over the three families' expert shapes on the H200
# (scripts/wgrad_probe.py; docs/perf-notes.md): 4 warps keep a float32 gradient tile's epilogue fast.
BM, BN, BK, WARPS, STAGES = 128, 128, 64, 4, 3


def add_kgrouped(grad_EDN: torch.Tensor, x_XD: torch.Tensor, dy_XN: torch.Tensor, offs_E: torch.Tensor,
               config: tuple = (BM, BN, BK, WARPS, STAGES)) -> None:
    """grad[e] += x[rows of e]^T dy[rows of e] in place (rows sorted by expert, offs_E the
    cumulative end row of each expert); grad float32 or bf16, contiguous."""
    E, D, N = grad_EDN.shape
    assert grad_EDN.is_contiguous() and x_XD.stride(1) == 1 and dy_XN.stride(1) == 1
    bm, bn, bk, warps, stages = config
    grid = (triton.cdiv(D, bm) * triton.cdiv(N, bn), E)
    _wgrad_accum_kernel[grid](x_XD, dy_XN, grad_EDN, offs_E, D, N, x_XD.stride(0), dy_XN.stride(0),
                              grad_EDN.stride(0), grad_EDN.stride(1), BM=bm, BN=bn, BK=bk,
                              num_warps=warps, num_stages=stages)
