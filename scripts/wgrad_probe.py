"""Expert weight-gradient accumulation on one GPU: kernels/wgrad_triton.py's in-place GEMM against
what autograd does (torch's k-grouped `F.grouped_mm` making a bf16 gradient, then `add_` into the
existing bf16 gradient, or into the float32 master's as parallelize.bf16_weights does), at the
bench's expert shapes, for each tile configuration given.

    python scripts/wgrad_probe.py [--configs 128,256,64,8,3,1,1 ...] [--first] [--json FILE]

(a configuration: BM, BN, BK, warps, stages, gradient tile loaded first (0/1), programs per SM (0: one
per tile); kernels/wgrad_triton.py; without --configs, its CONFIGS for each gradient dtype)

--first: a float32 master's first micro-batch instead, the kernel writing the gradient without
reading it (add=False) against torch's GEMM and the cast into float32 (what autograd and
bf16_weights' hook did).

One row per shape, target dtype and configuration: milliseconds (CUDA events, median of 10 after 3
warm-up runs), the ratio to autograd's two kernels, TFLOP/s of the GEMM part and the relative error
against the float64 product added to the same gradient."""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from pithtrain.bench import time_steps
from pithtrain.kernels.wgrad_triton import CONFIGS, add_kgrouped

SHAPES = {  # name: (experts, rows = 8192 tokens x top-k, D, N) of the weight gradient dw[e] (D x N)
    "qwen3 w13": (128, 65536, 2048, 1536), "qwen3 w2": (128, 65536, 768, 2048),
    "deepseek w13": (64, 49152, 2048, 2816), "deepseek w2": (64, 49152, 1408, 2048),
    "gpt-oss w13": (32, 32768, 2880, 5760), "gpt-oss w2": (32, 32768, 2880, 2880),
}


def ms(fn):
    return statistics.median(time_steps(fn, 3, 10)[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="*", default=[])
    ap.add_argument("--first", action="store_true", help="float32 gradients written, not added to")
    ap.add_argument("--json")
    args = ap.parse_args()
    given = [tuple(int(v) for v in c.split(",")) for c in args.configs]
    given = [c[:5] + (bool(c[5]), c[6]) for c in given]
    rows = []
    for name, (E, X, D, N) in SHAPES.items():
        torch.manual_seed(0)
        counts = torch.multinomial(torch.ones(E), X, replacement=True).bincount(minlength=E)
        offs = counts.cumsum(0).to(torch.int32).cuda()
        x = torch.randn(X, D, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(X, N, device="cuda", dtype=torch.bfloat16) / 16
        flop = 2 * X * D * N
        gemm = ms(lambda: F.grouped_mm(x.t(), dy, offs=offs))
        for dtype in (torch.float32,) if args.first else (torch.bfloat16, torch.float32):
            g = torch.zeros(E, D, N, device="cuda", dtype=dtype)
            if args.first:
                base = ms(lambda: F.grouped_mm(x.t(), dy, offs=offs).to(torch.float32))
            else:
                base = ms(lambda: g.add_(F.grouped_mm(x.t(), dy, offs=offs)))
            ref = (F.grouped_mm(x.float().t(), dy.float(), offs=offs)).double() if D * N * E < 6e8 else None
            for cfg in given or [CONFIGS["write" if args.first else dtype]]:
                g.zero_()
                try:
                    add_kgrouped(g, x, dy, offs, config=cfg, add=not args.first)
                    err = float((g.double() - ref).norm() / ref.norm()) if ref is not None else float("nan")
                    t = ms(lambda: add_kgrouped(g, x, dy, offs, config=cfg, add=not args.first))
                except Exception as e:  # a tile configuration the compiler refuses
                    print(f"{name} {dtype} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                row = dict(shape=name, target=str(dtype).removeprefix("torch."), config=cfg, gemm_ms=gemm,
                           autograd_ms=base, kernel_ms=t, ratio=base / t, kernel_tflops=flop / t / 1e9,
                           gemm_tflops=flop / gemm / 1e9, rel_err=err)
                rows.append(row)
                print(f"{name:13s} {row['target']:8s} {str(cfg):22s} gemm {gemm:.3f} ({row['gemm_tflops']:.0f} TF/s)"
                      f" | autograd {base:.3f} | kernel {t:.3f} ({row['kernel_tflops']:.0f} TF/s) "
                      f"| {row['ratio']:.2f}x | err {err:.1e}", flush=True)
            del g
    sums = {}
    for r in rows:
        key = (r["target"], str(r["config"]))
        sums[key] = (sums.get(key, (0, 0))[0] + r["kernel_ms"], sums.get(key, (0, 0))[1] + r["autograd_ms"])
    print("sum over the shapes a configuration ran (kernel ms, autograd ms):")
    for (target, cfg), (k, a) in sorted(sums.items(), key=lambda kv: (kv[0][0], kv[1][0])):
        print(f"{target:8s} {cfg:36s} {k:7.2f} {a:7.2f} ({a / k:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
