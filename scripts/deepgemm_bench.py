"""Grouped expert GEMMs at the bench's expert shapes: torch bf16 grouped_mm vs DeepGEMM bf16 m-grouped
vs DeepGEMM FP8 m-grouped (activation quantisation and padding included; weights quantised once, as
the per-step cache does) vs pithtrain's Triton FP8, forward GEMMs; then FP8 fwd+bwd (DeepGEMM vs Triton
vs bf16). TFLOP/s from CUDA events, median of 20 after 3 warm-ups; counts only real rows.

  PYTHONPATH=.:/tmp/dg-site python scripts/deepgemm_bench.py [--budget-s 150]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pithtrain.bench import time_steps
from pithtrain.config import load_config
from pithtrain.kernels import deepgemm, fp8, fp8_linear

MODELS = ["qwen3-30b-a3b", "deepseek-v2-lite", "gpt-oss-20b"]  # recipes: experts, widths, top-k read from them
TOKENS = 2 * 4096


def timed(fn, iters=20):
    """Median ms of `iters` calls after 3 warm-up calls (CUDA events: the bench's own timer)."""
    return statistics.median(time_steps(fn, 3, iters)[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=150)
    args = ap.parse_args()
    start = time.time()
    why = []
    dg = deepgemm.load(why)
    print("deep_gemm:", dg.__version__ if dg else f"not loadable ({'; '.join(why)})", flush=True)
    rows_out = []
    for model in MODELS:
        m = load_config(model).model
        E, D, F_, k = m.num_experts, m.hidden_size, getattr(m, m.expert_width_field), m.top_k
        M = TOKENS * k
        g = torch.Generator(device="cuda").manual_seed(0)
        counts = torch.multinomial(torch.ones(E, device="cuda"), M, replacement=True, generator=g).bincount(minlength=E)
        offs = counts.cumsum(0).int()
        for which, (K, N) in (("w13", (D, 2 * F_)), ("w2", (F_, D))):
            if time.time() - start > args.budget_s:
                print(f"budget of {args.budget_s} s spent: skipping {model} {which}", flush=True)
                continue
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = (torch.randn(E, K, N, device="cuda") / K ** 0.5).bfloat16()
            flop = 2 * M * K * N
            res = {}

            def run(label, fn):
                try:
                    res[label] = flop / timed(fn) / 1e9
                except Exception as e:  # one failing kernel must not hide the others
                    res[label] = float("nan")
                    print(f"  {model} {which} {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)

            run("torch bf16", lambda: F.grouped_mm(x, w, offs=offs))
            wq, wqt, ws = fp8.quant_blocks(w)
            run("triton fp8", lambda: fp8.mgrouped_mm(*fp8.quant_rows(x), wqt, ws, offs))
            if dg is not None:
                w_t = w.transpose(1, 2).contiguous()
                run("dg bf16", lambda: deepgemm.mgrouped_bf16(dg, x, w_t, offs))
                ws_t = ws.transpose(1, 2).contiguous()

                def dg_fp8():
                    p = deepgemm.plan(offs, M)
                    return deepgemm.unpad(deepgemm.mgrouped_fp8(dg, deepgemm.pad(x, p), wqt, ws_t, p), p)
                run("dg fp8", dg_fp8)
                # fwd + bwd of the autograd GEMMs (weight cache warm: quantised once per step)
                xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
                dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
                mm_dg, mm_tk = deepgemm.FP8GroupedMM(dg), fp8_linear.FP8GroupedMM()
                run("bf16 f+b", lambda: F.grouped_mm(xr, wr, offs=offs).backward(dy))
                run("triton fp8 f+b", lambda: mm_tk(xr, wr, offs).backward(dy))
                run("dg fp8 f+b", lambda: mm_dg(xr, wr, offs).backward(dy))
                for key in ("bf16 f+b", "triton fp8 f+b", "dg fp8 f+b"):
                    res[key] *= 3  # fwd + dgrad + wgrad: three GEMMs of `flop`
            rows_out.append((model, which, M, K, N, res))
            print(f"{model} {which} M={M} K={K} N={N}: " +
                  ", ".join(f"{k} {v:.0f}" for k, v in res.items()) + f"  [{time.time() - start:.0f} s]", flush=True)
    cols = ["torch bf16", "dg bf16", "triton fp8", "dg fp8", "bf16 f+b", "triton fp8 f+b", "dg fp8 f+b"]
    print("\nTFLOP/s (median of 20, CUDA events; FP8 includes activation quantisation and padding)")
    print(f"{'model':18} {'gemm':4} {'M x K x N':>20} " + " ".join(f"{c:>14}" for c in cols))
    for model, which, M, K, N, res in rows_out:
        print(f"{model:18} {which:4} {f'{M}x{K}x{N}':>20} " +
              " ".join(f"{res.get(c, float('nan')):14.0f}" for c in cols))


if __name__ == "__main__":
    main()
