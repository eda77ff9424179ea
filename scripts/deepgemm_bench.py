"""The experts' FP8 GEMMs at the bench's expert shapes (8192 tokens, top-k rows spread over all
experts), through the autograd paths the models use, against torch's bf16 `grouped_mm`:

  bf16        models.common.grouped_mm (F.grouped_mm)
  triton fp8  fp8_linear.FP8GroupedMM (Triton quantisation + GEMMs)
  dg fp8      deepgemm.FP8GroupedMM (Triton quantisation into the padded layout + DeepGEMM)

Forward alone, then forward + backward (data grad + weight grad; the FP8 paths' weight grad is bf16).
Activation quantisation included; weights quantised once per step by the cache (warm here, as for
every micro-batch after a step's first). Median ms of 20 CUDA-event timings after 3 warm-ups.

    PYTHONPATH=$PWD:/tmp/dg-site python3 scripts/deepgemm_bench.py
"""

import statistics

import torch
import torch.nn.functional as F

from pithtrain.bench import time_steps
from pithtrain.config import load_config
from pithtrain.kernels import deepgemm, fp8_linear

MODELS = ["qwen3-30b-a3b", "deepseek-v2-lite", "gpt-oss-20b"]
TOKENS = 2 * 4096


def ms(fn):
    return statistics.median(time_steps(fn, 3, 20)[0])


def expert_shapes(models=MODELS):
    """(model, which, E, M, K, N, offs) per expert GEMM: all experts, the top-k rows of TOKENS tokens
    drawn uniformly (the bench's random routing), offs their cumulative ends (int32, CUDA)."""
    for model in models:
        m = load_config(model).model
        E, D, F_, k = m.num_experts, m.hidden_size, getattr(m, m.expert_width_field), m.top_k
        M = TOKENS * k
        g = torch.Generator(device="cuda").manual_seed(0)
        counts = torch.multinomial(torch.ones(E, device="cuda"), M, replacement=True, generator=g).bincount(minlength=E)
        offs = counts.cumsum(0).int()
        for which, (K, N) in (("w13", (D, 2 * F_)), ("w2", (F_, D))):
            yield model, which, E, M, K, N, offs


def load_deepgemm():
    why = []
    dg = deepgemm.load(why)
    if dg is None:
        raise SystemExit(f"deep_gemm not loadable: {'; '.join(why)}")
    return dg


def main():
    dg, rows = load_deepgemm(), []
    for model, which, E, M, K, N, offs in expert_shapes():
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.nn.Parameter((torch.randn(E, K, N, device="cuda") / K ** 0.5).bfloat16())
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        paths = {"bf16": lambda a, b, o: F.grouped_mm(a, b, offs=o),
                 "triton fp8": fp8_linear.FP8GroupedMM(), "dg fp8": deepgemm.FP8GroupedMM(dg)}
        t = {}
        for name, mm in paths.items():
            with torch.no_grad():
                t[name + " fwd"] = ms(lambda: mm(x, w, offs))
            t[name + " f+b"] = ms(lambda: torch.autograd.backward(mm(x, w, offs), dy))
        rows.append((model, which, M, K, N, t))
        print(f"{model} {which} M={M} K={K} N={N}: " + ", ".join(f"{k} {v:.3f}" for k, v in t.items()), flush=True)
    print("\nms (median of 20; FP8 with activation quantisation, weight cache warm); ratio = bf16 / path")
    print(f"{'model':17} {'gemm':4} {'bf16 fwd':>9} {'triton':>13} {'deepgemm':>13} {'bf16 f+b':>9} {'triton':>13} {'deepgemm':>13}")
    for model, which, M, K, N, t in rows:
        cells = []
        for kind in ("fwd", "f+b"):
            b = t[f"bf16 {kind}"]
            cells.append(f"{b:9.3f}")
            for name in ("triton fp8", "dg fp8"):
                v = t[f"{name} {kind}"]
                cells.append(f"{v:6.3f} {b / v:5.2f}x")
        print(f"{model:17} {which:4} " + " ".join(cells))


if __name__ == "__main__":
    main()
