"""Issue 9, call 9: candidate M-grouped FP8 kernels against the current one and bf16, on one GPU.

    python scripts/fp8_variants.py --out DIR

Variants (each checked against pithtrain.kernels.fp8.mgrouped_mm on the same FP8 operands):
  cur        the current kernel (autotuned)
  ptr-r0/r1  the same kernel body with explicit configs; r0 = launch order row tiles fastest (as
             now), r1 = column tiles fastest (a row tile of A stays in L2 across its N tiles)
  tma-*      A and B loaded through TMA descriptors, column tiles fastest; s = scaled each K step,
             l = scaled one step late, w = tl.range(warp_specialize=True), p = plain FP8 dot with no
             per-step scaling (not a valid recipe: the ceiling the scaling costs against)
Also: bf16 and FP8 weight-gradient GEMMs, weight quantisation, and cuBLAS blockwise F.scaled_mm for
the LM head's forward and data-grad GEMMs. Full rows to DIR/variants.json; a short table last."""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pithtrain.bench import time_steps
from pithtrain.kernels import fp8 as tk


def timeit(fn, n=20, warm=5):
    return statistics.median(time_steps(fn, warm, n)[0])


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@triton.jit
def _lookup(offs_ptr, pid_m, G, GP: tl.constexpr, BM: tl.constexpr):
    gs = tl.arange(0, GP)
    ends = tl.load(offs_ptr + gs, mask=gs < G, other=0).to(tl.int32)
    starts = tl.load(offs_ptr + gs - 1, mask=(gs > 0) & (gs < G), other=0).to(tl.int32)
    n_tiles = tl.where(gs < G, (ends - starts + BM - 1) // BM, 0)
    g_sel = tl.sum((tl.cumsum(n_tiles, 0) <= pid_m).to(tl.int32), 0)
    t0 = tl.sum(tl.where(gs < g_sel, n_tiles, 0), 0)
    row0 = tl.sum(tl.where(gs == g_sel, starts, 0), 0) + (pid_m - t0) * BM
    row_end = tl.sum(tl.where(gs == g_sel, ends, 0), 0)
    return g_sel, row0, row_end


@triton.jit
def _ptr_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, offs_ptr, M, N, K, G,
                sa_m, sb_g, sb_n, sbs_g, sbs_k, sbs_n, sc_m, n_rows,
                GP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RASTER: tl.constexpr):
    pid = tl.program_id(0)
    n_n = tl.cdiv(N, BN)
    if RASTER == 0:
        pid_m, pid_n = pid % n_rows, pid // n_rows
    else:
        pid_m, pid_n = pid // n_n, pid % n_n
    g_sel, row0, row_end = _lookup(offs_ptr, pid_m, G, GP, BM)
    if g_sel >= G:
        return
    rm = row0 + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_mask = rm < row_end
    n_mask = rn < N
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * sa_m + rk[None, :]
    b_ptrs = b_ptr + g_sel.to(tl.int64) * sb_g + rn[None, :].to(tl.int64) * sb_n + rk[:, None]
    bs_ptrs = bs_ptr + g_sel * sbs_g + (rn // BK) * sbs_n
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    prev = tl.zeros((BM, BN), dtype=tl.float32)
    psa = tl.zeros((BM,), dtype=tl.float32)
    psb = tl.zeros((BN,), dtype=tl.float32)
    for kb in range(0, (K + BK - 1) // BK):
        a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
        cur = tl.dot(a, b)
        acc += prev * psa[:, None] * psb[None, :]
        psa = tl.load(as_ptr + kb * M + rm, mask=m_mask, other=0.0)
        psb = tl.load(bs_ptrs + kb * sbs_k, mask=n_mask, other=0.0)
        prev = cur
        a_ptrs += BK
        b_ptrs += BK
    acc += prev * psa[:, None] * psb[None, :]
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * sc_m + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _tma_kernel(a_desc, as_ptr, b_desc, bs_ptr, c_ptr, offs_ptr, M, N, K, G, sbs_g, sbs_k, sbs_n, sc_m,
                GP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                MODE: tl.constexpr, WS: tl.constexpr):
    pid = tl.program_id(0)
    n_n = tl.cdiv(N, BN)
    pid_m, pid_n = pid // n_n, pid % n_n
    g_sel, row0, row_end = _lookup(offs_ptr, pid_m, G, GP, BM)
    if g_sel >= G:
        return
    rm = row0 + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_mask = rm < row_end
    n_mask = rn < N
    bs_ptrs = bs_ptr + g_sel * sbs_g + (rn // BK) * sbs_n
    brow = g_sel * N + pid_n * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if MODE == 1:  # late
        prev = tl.zeros((BM, BN), dtype=tl.float32)
        psa = tl.zeros((BM,), dtype=tl.float32)
        psb = tl.zeros((BN,), dtype=tl.float32)
        for kb in tl.range(0, (K + BK - 1) // BK, warp_specialize=WS):
            a = a_desc.load([row0, kb * BK])
            b = b_desc.load([brow, kb * BK])
            cur = tl.dot(a, b.T)
            acc += prev * psa[:, None] * psb[None, :]
            psa = tl.load(as_ptr + kb * M + rm, mask=m_mask, other=0.0)
            psb = tl.load(bs_ptrs + kb * sbs_k, mask=n_mask, other=0.0)
            prev = cur
        acc += prev * psa[:, None] * psb[None, :]
    elif MODE == 0:  # scaled right after each dot
        for kb in tl.range(0, (K + BK - 1) // BK, warp_specialize=WS):
            a = a_desc.load([row0, kb * BK])
            b = b_desc.load([brow, kb * BK])
            sa = tl.load(as_ptr + kb * M + rm, mask=m_mask, other=0.0)
            sb = tl.load(bs_ptrs + kb * sbs_k, mask=n_mask, other=0.0)
            acc += tl.dot(a, b.T) * sa[:, None] * sb[None, :]
    else:  # plain
        for kb in tl.range(0, (K + BK - 1) // BK, warp_specialize=WS):
            a = a_desc.load([row0, kb * BK])
            b = b_desc.load([brow, kb * BK])
            acc = tl.dot(a, b.T, acc)
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * sc_m + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def run_ptr(a, a_s, b, b_s, offs, raster, BN, st, w):
    M, K = a.shape
    G, N, _ = b.shape
    c = torch.empty(M, N, device=a.device, dtype=torch.bfloat16)
    n_rows = triton.cdiv(M, 128) + G
    _ptr_kernel[(n_rows * triton.cdiv(N, BN),)](
        a, a_s, b, b_s, c, offs, M, N, K, G, a.stride(0), b.stride(0), b.stride(1),
        b_s.stride(0), b_s.stride(1), b_s.stride(2), c.stride(0), n_rows,
        GP=triton.next_power_of_2(G), BM=128, BN=BN, BK=128, RASTER=raster, num_stages=st, num_warps=w)
    return c


def run_tma(a, a_s, b, b_s, offs, mode, ws, BN, st, w):
    M, K = a.shape
    G, N, _ = b.shape
    c = torch.empty(M, N, device=a.device, dtype=torch.bfloat16)
    ad = TensorDescriptor.from_tensor(a, [128, 128])
    bd = TensorDescriptor.from_tensor(b.view(G * N, K), [BN, 128])
    n_rows = triton.cdiv(M, 128) + G
    _tma_kernel[(n_rows * triton.cdiv(N, BN),)](
        ad, a_s, bd, b_s, c, offs, M, N, K, G, b_s.stride(0), b_s.stride(1), b_s.stride(2), c.stride(0),
        GP=triton.next_power_of_2(G), BM=128, BN=BN, BK=128, MODE=mode, WS=ws, num_stages=st, num_warps=w)
    return c


CONFIGS = [(128, 3, 8), (128, 4, 8), (128, 4, 4), (128, 5, 8), (256, 3, 8)]


def grouped_shapes():
    """(name, M rows, K, N, G) at the bench's Qwen3 / DeepSeek routed-expert shapes (8192 tokens)."""
    return [("qwen3 w13 fwd", 8, 128, 2048, 1536), ("qwen3 w13 dgrad", 8, 128, 1536, 2048),
            ("qwen3 w2 fwd", 8, 128, 768, 2048), ("qwen3 w2 dgrad", 8, 128, 2048, 768),
            ("deepseek w13 fwd", 6, 64, 2048, 2816), ("deepseek w2 fwd", 6, 64, 1408, 2048)]


def bench_mgrouped(rows, table):
    gen = torch.Generator().manual_seed(1)
    for name, k_top, E, K, N in grouped_shapes():
        idx = torch.rand(8192, E, generator=gen).topk(k_top, dim=1).indices
        counts = torch.bincount(idx.flatten(), minlength=E).cuda()
        offs = counts.cumsum(0).int()
        M = int(counts.sum())
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(E, K, N, device="cuda") * K ** -0.5).bfloat16()
        wq, wqt, ws = tk.quant_blocks(w)
        xq, xs = tk.quant_rows(x)
        ref = tk.mgrouped_mm(xq, xs, wqt, ws, offs)
        flops = 2 * M * K * N
        tb = timeit(lambda: F.grouped_mm(x, w, offs=offs))
        tq = timeit(lambda: tk.quant_rows(x))
        tc = timeit(lambda: tk.mgrouped_mm(xq, xs, wqt, ws, offs))
        best = {"bf16": (tb, None), "cur": (tc, None)}
        variants = [(f"ptr-r{r}", lambda bn, st, w_, r=r: run_ptr(xq, xs, wqt, ws, offs, r, bn, st, w_))
                    for r in (0, 1)]
        variants += [(f"tma-{tag}", lambda bn, st, w_, m=m, s=s: run_tma(xq, xs, wqt, ws, offs, m, s, bn, st, w_))
                     for tag, m, s in (("s", 0, False), ("l", 1, False), ("sw", 0, True), ("lw", 1, True),
                                       ("p", 2, False), ("pw", 2, True))]
        for vname, fn in variants:
            for bn, st, w_ in CONFIGS:
                row = dict(shape=name, M=M, K=K, N=N, variant=vname, BN=bn, stages=st, warps=w_)
                try:
                    out = fn(bn, st, w_)
                    err = rel(out, ref)
                    t = timeit(lambda: fn(bn, st, w_))
                    row.update(ms=t, tflops=flops / t / 1e9, rel_vs_cur=err)
                    ok = err < 1e-2 or vname.startswith("tma-p")
                    if ok and t < best.get(vname, (1e9,))[0]:
                        best[vname] = (t, (bn, st, w_))
                except Exception as e:  # noqa: BLE001 -- reported, not hidden
                    row.update(error=str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
                rows.append(row)
                print(json.dumps(row), flush=True)
        for vname, (t, cfg) in best.items():
            table.append(f"| {name} | {vname} | {cfg} | {t:.3f} | {flops / t / 1e9:.0f} | "
                         f"{tb / t:.2f} | {tb / (t + tq) if vname not in ('bf16',) else 1.0:.2f} |")


def bench_wgrad(rows, table):
    gen = torch.Generator().manual_seed(2)
    for name, k_top, E, K, N in (("qwen3 w13", 8, 128, 2048, 1536), ("qwen3 w2", 8, 128, 768, 2048)):
        idx = torch.rand(8192, E, generator=gen).topk(k_top, dim=1).indices
        counts = torch.bincount(idx.flatten(), minlength=E).cuda()
        offs = counts.cumsum(0).int()
        M = int(counts.sum())
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(E, K, N, device="cuda", dtype=torch.bfloat16)
        tb = timeit(lambda: F.grouped_mm(x.t(), dy, offs=offs))

        def f8():
            a, sa = tk.quant_cols_t(x)
            b, sb = tk.quant_cols_t(dy)
            return tk.kgrouped_mm(a, sa, b, sb, offs, out)
        t8 = timeit(f8)
        tw = timeit(lambda: tk.quant_blocks(torch.empty(E, K, N, device="cuda", dtype=torch.bfloat16).normal_()))
        tn = timeit(lambda: torch.empty(E, K, N, device="cuda", dtype=torch.bfloat16).normal_())
        r = dict(shape=f"{name} wgrad", bf16_ms=tb, fp8_ms=t8, quant_blocks_ms=tw - tn)
        rows.append(r)
        print(json.dumps(r), flush=True)
        table.append(f"| {name} wgrad | bf16 {tb:.3f} ms | fp8+quant {t8:.3f} ms | weight quant/step {tw - tn:.3f} ms |")


def bench_lm_head(rows, table):
    """cuBLAS blockwise F.scaled_mm for the LM head chunk (4096 x 2048 x 151936): forward
    (x 1x128, W 128x128) and data grad (dlogits 1x128 along V, W^T 128x128), quantisation included."""
    from torch.nn.functional import ScalingType
    T, D, V = 4096, 2048, 151936
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    W = (torch.randn(V, D, device="cuda") * D ** -0.5).bfloat16()
    g = (torch.randn(T, V, device="cuda") * 1e-3).bfloat16()
    q, qt, s = tk.quant_blocks(W.t().unsqueeze(0))  # (1, D, V) view of W^T: q = W^T, qt = W, s (1, D/128, V/128)
    sW_fwd = s[0].t().contiguous().t()  # (D/128, V/128), stride (1, D/128)
    kb = V // 128
    L4 = -(-kb // 4) * 4
    sW_bwd = torch.zeros(D // 128, L4, device="cuda")
    sW_bwd[:, :kb] = s[0]
    sW_bwd = sW_bwd.t()  # (L4, D/128) stride (1, L4)
    res = {}

    def fwd():
        xq, xs = tk.quant_rows(x)
        return F.scaled_mm(xq, qt[0].t(), xs.t(), ScalingType.BlockWise1x128, sW_fwd,
                           ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)

    def dgrad():
        gq, gs = tk.quant_rows(g)  # gs (V/128, T): .t() is (T, V/128) with stride (1, T)
        return F.scaled_mm(gq, q[0].t(), gs.t(), ScalingType.BlockWise1x128, sW_bwd,
                           ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)

    for part, f8, bf in (("fwd", fwd, lambda: x @ W.t()), ("dgrad", dgrad, lambda: g @ W)):
        r = dict(shape=f"lm_head {part}")
        try:
            r.update(rel=rel(f8(), bf()), bf16_ms=timeit(bf), fp8_ms=timeit(f8))
            r["speedup"] = r["bf16_ms"] / r["fp8_ms"]
        except Exception as e:  # noqa: BLE001
            r.update(error=str(e).splitlines()[0][:300])
        res[part] = r
        rows.append(r)
        print(json.dumps(r), flush=True)
        table.append(f"| {r['shape']} | " + " | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                         for k, v in r.items() if k != "shape") + " |")
    r = dict(shape="lm_head quant g rows", ms=timeit(lambda: tk.quant_rows(g)),
             quant_W_ms=timeit(lambda: tk.quant_blocks(W.t().unsqueeze(0))))
    rows.append(r)
    table.append(f"| quant dlogits chunk {r['ms']:.3f} ms | quant W both layouts {r['quant_W_ms']:.3f} ms |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", default="mg,wgrad,lm")
    args = ap.parse_args()
    rows, table = [], []
    only = args.only.split(",")
    try:
        if "mg" in only:
            table.append("| shape | variant | (BN, stages, warps) | ms | TFLOP/s | bf16/this | bf16/(this+quant x) |")
            bench_mgrouped(rows, table)
        if "wgrad" in only:
            bench_wgrad(rows, table)
        if "lm" in only:
            bench_lm_head(rows, table)
    finally:
        with open(f"{args.out}/variants.json", "w") as f:
            json.dump(rows, f, indent=1)
        print("\n".join(table))


if __name__ == "__main__":
    main()
