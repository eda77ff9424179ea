"""FP8 operator check and timing on one GPU: Triton blockwise kernels against the PyTorch reference
(pithtrain.kernels.fp8_linear) and against bf16 at the bench's expert and dense shapes.

    python scripts/fp8_probe.py [--out DIR]

Prints one row per measurement: per shape, forward and data grad in bf16 and in FP8 (activation
quantisation included), the ratio, and the FP8 result's relative error against bf16 (the weight
grad runs in bf16 in both modes). CUDA events, median of 20 after 5 warm-up runs."""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from pithtrain.bench import time_steps
from pithtrain.kernels import fp8 as tk
from pithtrain.kernels import fp8_linear as fp8


def timeit(fn, n=20, warm=5):
    """Median milliseconds of `n` runs after `warm` (CUDA events: the bench's own timer)."""
    return statistics.median(time_steps(fn, warm, n)[0])


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def routed_counts(T, E, k, gen):
    """Row counts per expert for T tokens each picking k distinct experts at random."""
    idx = torch.rand(T, E, generator=gen).topk(k, dim=1).indices
    return torch.bincount(idx.flatten(), minlength=E)


def check_kernels(rows):
    """Triton against the PyTorch reference on odd shapes (partial blocks, empty groups)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1000, 700, generator=g) * 5).cuda().bfloat16()
    (q1, s1), (q2, s2) = tk.quant_rows(x), fp8.quant_rows(x)
    rows.append(dict(check="quant_rows", q_equal=(q1.float() == q2.float()).float().mean().item(), s_rel=rel(s1, s2)))
    w = torch.randn(3, 300, 700, generator=g).cuda()
    a, b = tk.quant_blocks(w), fp8.quant_blocks(w)
    rows.append(dict(check="quant_blocks", q_equal=(a[0].float() == b[0].float()).float().mean().item(),
                     qt_equal=(a[1].float() == b[1].float()).float().mean().item(), s_rel=rel(a[2], b[2])))
    counts = torch.tensor([300, 0, 700], device="cuda")
    offs = counts.cumsum(0).int()
    xq, xs = tk.quant_rows(x[:, :300].float())
    wq, wqt, ws = tk.quant_blocks(w)
    rows.append(dict(check="mgrouped", rel=rel(tk.mgrouped_mm(xq, xs, wqt, ws, offs),
                                               fp8.mgrouped_mm(xq, xs, wqt, ws, offs))))


def bench_grouped(name, T, E, k, D, Fh, rows):
    gen = torch.Generator().manual_seed(1)
    counts = routed_counts(T, E, k, gen).cuda()
    offs = counts.cumsum(0).int()
    M = int(counts.sum())
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    for wname, K, N in (("w13", D, 2 * Fh), ("w2", Fh, D)):
        xx = x if K == D else torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(E, K, N, device="cuda") * K ** -0.5).bfloat16()
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        ref_y = F.grouped_mm(xx, w, offs=offs)
        ref_dx = F.grouped_mm(dy, w.transpose(1, 2), offs=offs)
        wq, wqt, ws = tk.quant_blocks(w)

        def fwd():
            q, s = tk.quant_rows(xx)
            return tk.mgrouped_mm(q, s, wqt, ws, offs)

        def dgrad():
            q, s = tk.quant_rows(dy)
            return tk.mgrouped_mm(q, s, wq, ws.transpose(1, 2), offs)

        flops = 2 * M * K * N
        for part, f8, bf, ref in (
                ("fwd", fwd, lambda: F.grouped_mm(xx, w, offs=offs), ref_y),
                ("dgrad", dgrad, lambda: F.grouped_mm(dy, w.transpose(1, 2), offs=offs), ref_dx)):
            t8, tb = timeit(f8), timeit(bf)
            rows.append(dict(shape=f"{name} {wname} {part}", M=M, K=K, N=N, bf16_ms=tb, fp8_ms=t8,
                             speedup=tb / t8, fp8_tflops=flops / t8 / 1e9, bf16_tflops=flops / tb / 1e9,
                             rel_err=rel(f8(), ref)))
        try:  # PyTorch's rowwise-scaled grouped GEMM (CUTLASS), GEMM alone, for comparison
            xq, _ = tk.quant_rows(xx)
            sa = torch.rand(M, device="cuda") + 0.5
            sb = torch.rand(E, N, device="cuda") + 0.5
            tr = timeit(lambda: torch._scaled_grouped_mm(xq, wqt.transpose(1, 2), sa, sb, offs=offs,
                                                         out_dtype=torch.bfloat16))
            rows.append(dict(shape=f"{name} {wname} rowwise _scaled_grouped_mm fwd (gemm only)", ms=tr,
                             speedup_vs_bf16=timeit(lambda: F.grouped_mm(xx, w, offs=offs)) / tr))
        except Exception as e:  # noqa: BLE001 -- reported, not hidden
            rows.append(dict(shape=f"{name} {wname} rowwise", error=str(e).splitlines()[0][:160]))
        rows.append(dict(shape=f"{name} {wname} quant_blocks", ms=timeit(lambda: tk.quant_blocks(w))))
        rows.append(dict(shape=f"{name} {wname} quant_rows x", ms=timeit(lambda: tk.quant_rows(xx))))


def bench_dense(name, M, K, N, rows):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") * K ** -0.5).bfloat16()
    offs = torch.tensor([M], device="cuda", dtype=torch.int32)
    wq, wqt, ws = tk.quant_blocks(w.t().unsqueeze(0))  # (1, K, N) view: qt is (1, N, K)
    ref = x @ w.t()

    def f8():
        q, s = tk.quant_rows(x)
        return tk.mgrouped_mm(q, s, wqt, ws, offs)

    t8, tb = timeit(f8), timeit(lambda: x @ w.t())
    row = dict(shape=f"{name} dense fwd", M=M, K=K, N=N, bf16_ms=tb, fp8_ms=t8, speedup=tb / t8,
               fp8_tflops=2 * M * K * N / t8 / 1e9, rel_err=rel(f8(), ref))
    try:  # cuBLAS blockwise (1x128, 128x128) through F.scaled_mm, if this build has it
        from torch.nn.functional import ScalingType
        bq = wqt[0].t()  # (K, N) column-major

        def cublas():
            q, s = tk.quant_rows(x)  # s.t(): (M, K/128) with stride (1, M), outer-dim-major
            return F.scaled_mm(q, bq, s.t(), ScalingType.BlockWise1x128, ws[0].t().contiguous().t(),
                               ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
        cublas()

        tc = timeit(cublas)
        row.update(cublas_ms=tc, cublas_speedup=tb / tc, cublas_rel=rel(cublas(), ref))
    except Exception as e:  # noqa: BLE001 -- reported, not hidden
        row.update(cublas_error=str(e).splitlines()[0][:160])
    rows.append(row)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="check,grouped,dense", help="comma list of check,grouped,dense")
    args = ap.parse_args()
    rows = []
    only = args.only.split(",")
    if "check" in only:
        check_kernels(rows)
    if "grouped" in only:
        bench_grouped("qwen3", 8192, 128, 8, 2048, 768, rows)
        bench_grouped("deepseek", 8192, 64, 6, 2048, 1408, rows)
    if "dense" in only:
        bench_dense("qwen3 q_proj", 8192, 2048, 4096, rows)
        bench_dense("qwen3 o_proj", 8192, 4096, 2048, rows)
        bench_dense("lm_head chunk", 4096, 2048, 151936, rows)
    rows.append(dict(autotuned={str(k): str(v) for k, v in tk._mgrouped_kernel.cache.items()}))
    for r in rows:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
    if args.out:
        with open(f"{args.out}/fp8_probe.json", "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
