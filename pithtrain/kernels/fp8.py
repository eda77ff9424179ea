"""Blockwise FP8 (e4m3) in Triton: quantisation and the M-grouped scaled GEMM (forward, data grad).

Reference: `kernels/fp8_linear.py` (the same functions in plain PyTorch; tests/test_fp8_gpu.py compares).

Scaling (DeepSeek-V3's recipe): activations per 1 x 128 tile along the contraction dimension,
weights per 128 x 128 block, one fp32 scale each, value = q * scale, scale = amax / 448.
Activation scales are stored contraction-block-major ([blocks, rows]) so the GEMM reads one
contiguous vector of them per K step. The GEMM takes both operands K-contiguous (the layout
Hopper's FP8 tensor cores read), so a weight is quantised into both layouts:

| GEMM | A (rows x K) | B[g] (cols x K) |
| --- | --- | --- |
| forward   y = x w     | x, 1x128 along D  | w^T (N x D), 128x128 |
| data grad dx = dy w^T | dy, 1x128 along N | w   (D x N), 128x128 |

`quant_rows(rows=...)` writes into DeepGEMM's padded layout (kernels/deepgemm.py). The ue8m0 flags round
scales up to powers of 2 (Blackwell's DeepGEMM kernels read them as exponents). No FP8 weight gradient
here: fp8_linear computes it in bf16 (measured faster at the routed experts' shapes,
docs/perf-notes.md). M-grouped: rows sorted by group, group g owns rows
[offs[g-1], offs[g]) and multiplies its own B. Every FP8 tensor made here has a row stride that is
a multiple of 16 bytes (the last dimension padded in storage), as the TMA descriptors require.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pithtrain.kernels import BLOCK, FP8


def _fp8_empty(*shape: int, device) -> torch.Tensor:
    """An e4m3 tensor of `shape` whose last dimension is padded to 16 bytes in storage (a view)."""
    *lead, last = shape
    return torch.empty(*lead, -(-last // 16) * 16, device=device, dtype=FP8)[..., :last]


# ---------------------------------------------------------------------------------------------
# Quantisation


@triton.jit
def _scale(amax, UE8M0: tl.constexpr):
    """(scale, 1 / scale) for an amax: amax / 448, or (UE8M0, Blackwell's DeepGEMM) rounded up to a power of 2."""
    if UE8M0:
        s = tl.exp2(tl.ceil(tl.log2(amax / 448.0)))
        inv = 1.0 / s
    else:
        s = amax / 448.0
        inv = 448.0 / amax
    return s, inv


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, rows_ptr, M, K, M_out, sx_m, sx_k, sq_m, BM: tl.constexpr,
                       BK: tl.constexpr, ROWS: tl.constexpr, UE8M0: tl.constexpr):
    """x (M, K) -> q (M_out, K) fp8, s (cdiv(K, BK), M_out): one scale per row per BK columns; row
    m goes to row rows_ptr[m] (ROWS) or m."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    kb = tl.program_id(1)
    rk = kb * BK + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None].to(tl.int64) * sx_m + rk[None, :] * sx_k, mask=mask, other=0.0).to(tl.float32)
    s, inv = _scale(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30), UE8M0)
    q = tl.clamp(x * inv[:, None], -448.0, 448.0)
    dst = tl.load(rows_ptr + rm, mask=rm < M, other=0).to(tl.int64) if ROWS else rm.to(tl.int64)
    tl.store(q_ptr + dst[:, None] * sq_m + rk[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + kb * M_out + dst, s, mask=rm < M)


@triton.jit
def _quant_blocks_kernel(w_ptr, q_ptr, s_ptr, R, C, sw_g, sw_r, sw_c, sq_g, sq_r, ss_g, ss_r, ss_c, B: tl.constexpr,
                         UE8M0: tl.constexpr):
    """w (G, R, C) -> q (G, R, C) fp8 (unit last stride), s (G, cdiv(R, B), cdiv(C, B)) (any strides)."""
    g = tl.program_id(2).to(tl.int64)
    rb, cb = tl.program_id(0), tl.program_id(1)
    rr = rb * B + tl.arange(0, B)
    rc = cb * B + tl.arange(0, B)
    mask = (rr[:, None] < R) & (rc[None, :] < C)
    w = tl.load(w_ptr + g * sw_g + rr[:, None] * sw_r + rc[None, :] * sw_c, mask=mask, other=0.0).to(tl.float32)
    s, inv = _scale(tl.maximum(tl.max(tl.max(tl.abs(w), axis=1), axis=0), 1e-30), UE8M0)
    q = tl.clamp(w * inv, -448.0, 448.0).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + g * sq_g + rr[:, None] * sq_r + rc[None, :], q, mask=mask)
    tl.store(s_ptr + g * ss_g + rb * ss_r + cb * ss_c, s)


@triton.jit
def _padded_layout_kernel(offs_ptr, rows_ptr, mi_ptr, M, G, ALIGN: tl.constexpr, GP: tl.constexpr,
                          BM: tl.constexpr):
    """Rows [pid * BM, +BM): each row's group g (the number of group ends <= the row) and its row in
    the padded layout (row + padded start of g - start of g); m_indices[that row] = g."""
    g = tl.arange(0, GP)
    ends = tl.load(offs_ptr + g, mask=g < G, other=2147483647).to(tl.int64)
    prev = tl.load(offs_ptr + g - 1, mask=(g > 0) & (g < G), other=0).to(tl.int64)
    counts = tl.where(g < G, ends - prev, 0)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    shift = tl.cumsum(padded, 0) - padded - prev
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    below = ends[None, :] <= r[:, None]  # (BM, GP): groups ending at or before each row
    grp = tl.sum(below.to(tl.int32), axis=1)
    mine = g[None, :] == grp[:, None]
    dst = r + tl.sum(tl.where(mine, shift[None, :], 0), axis=1)
    tl.store(rows_ptr + r, dst, mask=r < M)
    tl.store(mi_ptr + dst, grp, mask=r < M)


def padded_layout(offs_G: torch.Tensor, M: int, m_indices: torch.Tensor, align: int) -> torch.Tensor:
    """deepgemm.layout in two launches: rows (M,) int64, and each row's group written into
    m_indices (filled with -1 by the caller). offs_G: cumulative group ends (G <= 4096)."""
    rows = torch.empty(M, device=offs_G.device, dtype=torch.int64)
    G = len(offs_G)
    if M:
        _padded_layout_kernel[(triton.cdiv(M, 64),)](offs_G, rows, m_indices, M, G, ALIGN=align,
                                                     GP=max(16, triton.next_power_of_2(G)), BM=64, num_warps=4)
    return rows


def quant_rows(x: torch.Tensor, ue8m0: bool = False, rows: torch.Tensor | None = None,
               out_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (q (M, K) e4m3, s (cdiv(K, 128), M) fp32), 1 x 128 tiles along K (ue8m0: power-of-2 scales).
    `rows` (M,) with `out_rows`: row m is written at row rows[m] of q (out_rows, K) and s (., out_rows)
    (DeepGEMM's padded layout, kernels/deepgemm.py); rows not named are left unwritten."""
    M, K = x.shape
    M_out = M if rows is None else out_rows
    q = _fp8_empty(M_out, K, device=x.device)
    s = torch.empty(triton.cdiv(K, BLOCK), M_out, device=x.device, dtype=torch.float32)
    if M:
        _quant_rows_kernel[(triton.cdiv(M, 32), triton.cdiv(K, BLOCK))](
            x, q, s, x if rows is None else rows, M, K, M_out, x.stride(0), x.stride(1), q.stride(0), BM=32,
            BK=BLOCK, ROWS=rows is not None, UE8M0=ue8m0, num_warps=4)
    return q, s


def quant_blocks(w: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(G, R, C) any strides -> (q (G, R, C), q^T (G, C, R), s (G, cdiv(R, 128), cdiv(C, 128)))."""
    G, R, C = w.shape
    nrb, ncb = triton.cdiv(R, BLOCK), triton.cdiv(C, BLOCK)
    q = _fp8_empty(G, R, C, device=w.device)
    qt = _fp8_empty(G, C, R, device=w.device)
    s = torch.empty(G, nrb, ncb, device=w.device, dtype=torch.float32)
    # q^T: the same kernel over the transposed view (each block holds the same elements, so the
    # same codes, and the same scale, written again through s's transposed view). One kernel
    # writing both layouts would read w once (0.46 instead of 0.70 ms at Qwen3's w13), but on
    # triton 3.6 it gave wrong codes at (192, 384), whether the tile was transposed in fp8 (parts
    # of q^T unwritten) or in fp32 (q's rows constant); PyTorch's transposing copy cost ~13 ms per
    # Qwen3-4L step.
    for src, dst, sc in ((w, q, s), (w.transpose(1, 2), qt, s.transpose(1, 2))):
        _quant_blocks_kernel[(sc.shape[1], sc.shape[2], G)](
            src, dst, sc, src.shape[1], src.shape[2], *src.stride(), dst.stride(0), dst.stride(1), *sc.stride(),
            B=BLOCK, UE8M0=ue8m0, num_warps=8)
    return q, qt, s


# ---------------------------------------------------------------------------------------------
# M-grouped GEMM


def _a_block(nargs):
    nargs["a_desc"].block_shape = [nargs["BM"], BLOCK]


# BM = 128 rows with two warp groups, or 64 rows with one (then two or three programs share a
# multiprocessor, and one's scaling can overlap another's MMA).
_MGROUPED_CONFIGS = [triton.Config({"BM": bm}, num_stages=st, num_warps=w, pre_hook=_a_block)
                     for bm, w in ((128, 8), (64, 4)) for st in (3, 4, 5)]


@triton.autotune(configs=_MGROUPED_CONFIGS, key=["N", "K", "G"])
@triton.jit
def _mgrouped_kernel(a_desc, as_ptr, b_desc, bs_ptr, c_ptr, offs_ptr, M, N, K, G, sbs_g, sbs_k, sbs_n, sc_m,
                     GP: tl.constexpr, BM: tl.constexpr, B: tl.constexpr):
    """c[rows of g] = (a * as)[rows of g] @ (b[g] * bs[g])^T. a: descriptor over (M, K); b: over
    (G * N, K), group g's rows at g * N; as (cdiv(K, B), M); bs[g] indexed [k block, n block] with
    strides (sbs_k, sbs_n). Tiles are BM x B, K steps of B: one weight scale per K step of a tile."""
    # Column tiles vary fastest, so a row tile of A stays in L2 across its N tiles (measured
    # 1.1-1.2x over row tiles fastest at Qwen3's shapes: A is re-read from memory otherwise).
    pid = tl.program_id(0)
    n_n = tl.cdiv(N, B)
    pid_m, pid_n = pid // n_n, pid % n_n
    # Which group's row tile is pid_m? One vector load of the group ends and a scan.
    gs = tl.arange(0, GP)
    ends = tl.load(offs_ptr + gs, mask=gs < G, other=0).to(tl.int32)
    starts = tl.load(offs_ptr + gs - 1, mask=(gs > 0) & (gs < G), other=0).to(tl.int32)
    n_tiles = tl.where(gs < G, (ends - starts + BM - 1) // BM, 0)
    g_sel = tl.sum((tl.cumsum(n_tiles, 0) <= pid_m).to(tl.int32), 0)
    if g_sel >= G:
        return
    t0 = tl.sum(tl.where(gs < g_sel, n_tiles, 0), 0)
    row0 = tl.sum(tl.where(gs == g_sel, starts, 0), 0) + (pid_m - t0) * BM
    row_end = tl.sum(tl.where(gs == g_sel, ends, 0), 0)
    rm = row0 + tl.arange(0, BM)
    rn = pid_n * B + tl.arange(0, B)
    m_mask = rm < row_end
    brow = g_sel * N + pid_n * B
    bs_tile = bs_ptr + g_sel * sbs_g + pid_n * sbs_n
    # TMA loads whole tiles: rows past the group's end (another group's, or zeros past M) and
    # columns past N (the next group's weights) only reach outputs that the store masks off.
    # Block kb's product is scaled into acc one step late, so its MMA overlaps the previous
    # block's scaling; the two scales fold into one per row (one FMA per element).
    acc = tl.zeros((BM, B), dtype=tl.float32)
    prev = tl.zeros((BM, B), dtype=tl.float32)
    ps = tl.zeros((BM,), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, B)):
        a = a_desc.load([row0, kb * B])
        b = b_desc.load([brow, kb * B])
        cur = tl.dot(a, b.T)
        acc += prev * ps[:, None]
        ps = tl.load(as_ptr + kb * M + rm, mask=m_mask, other=0.0) * tl.load(bs_tile + kb * sbs_k)
        prev = cur
    acc += prev * ps[:, None]
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * sc_m + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & (rn < N)[None, :])


def mgrouped_mm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
                offs: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a (M, K) fp8 with 1x128 scales a_s (cdiv(K,128), M); b (G, N, K) fp8, K-contiguous, with
    128x128 scales b_s viewed (G, k block, n block); offs (G,) int32 cumulative row ends.
    Returns (M, N) in out_dtype; rows past offs[-1] are left unwritten (callers pass offs[-1] = M).
    Both operands need a unit last stride and 16-byte row strides (quant_rows / quant_blocks)."""
    M, K = a.shape
    G, N, _ = b.shape
    assert a.stride(1) == 1 and b.stride(2) == 1 and b.stride(0) == N * b.stride(1), \
        "FP8 GEMM operands must be K-contiguous, b's groups stacked"
    assert a.stride(0) % 16 == 0 and b.stride(1) % 16 == 0, "FP8 GEMM rows must be 16-byte aligned"
    c = torch.empty(M, N, device=a.device, dtype=out_dtype)
    if M == 0:
        return c
    a_desc = TensorDescriptor(a, [M, K], [a.stride(0), 1], [BLOCK, BLOCK])  # rows: the config's BM
    b_desc = TensorDescriptor(b, [G * N, K], [b.stride(1), 1], [BLOCK, BLOCK])
    grid = lambda meta: ((triton.cdiv(M, meta["BM"]) + G) * triton.cdiv(N, BLOCK),)  # noqa: E731
    _mgrouped_kernel[grid](a_desc, a_s, b_desc, b_s, c, offs, M, N, K, G,
                           b_s.stride(0), b_s.stride(1), b_s.stride(2), c.stride(0),
                           GP=triton.next_power_of_2(G), B=BLOCK)
    return c
