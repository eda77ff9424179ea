"""Issue #22: where the time of a DeepGEMM FP8 expert GEMM goes, piece by piece, at the bench's expert
shapes (8192 tokens, top-k rows spread over all experts), against torch's bf16 `grouped_mm`:

  bf16            F.grouped_mm forward (x w), data grad (dy w^T), weight grad (x^T dy)
  layout          deepgemm.layout (device only): rows and m_indices of the padded layout
  quant padded    fp8.quant_rows(x, rows=...): quantise each row into its padded place
  dg fp8 gemm     DeepGEMM's m-grouped contiguous FP8 GEMM alone (operands quantised, padded to the
                  bound M + G * 127, trailing tiles -1), forward and data grad
  unpad           the output rows gathered back
  dg bf16 gemm    DeepGEMM's m-grouped contiguous bf16 GEMM alone (x already padded)

Medians of CUDA-event timings (the bench's own timer). One process: a CUDA error ends the table.

    PYTHONPATH=$PWD:/tmp/dg-site python3 scripts/deepgemm_parts.py
"""

import statistics

import torch
import torch.nn.functional as F

from deepgemm_bench import expert_shapes, load_deepgemm  # scripts/: the same shapes and routing
from pithtrain.bench import time_steps
from pithtrain.kernels import deepgemm, fp8


def ms(fn, iters=20):
    return statistics.median(time_steps(fn, 3, iters)[0])


def main():
    dg, rows = load_deepgemm(), []
    for model, which, E, M, K, N, offs in expert_shapes():
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(E, K, N, device="cuda") / K ** 0.5).bfloat16()
        t = {}
        t["bf16 fwd"] = ms(lambda: F.grouped_mm(x, w, offs=offs))
        t["bf16 dgrad"] = ms(lambda: F.grouped_mm(dy, w.transpose(1, 2), offs=offs))
        t["bf16 wgrad"] = ms(lambda: F.grouped_mm(x.t(), dy, offs=offs))
        lay = deepgemm.layout(offs, M)
        Mp = len(lay.m_indices)
        t["layout"] = ms(lambda: deepgemm.layout(offs, M))
        wq, wqt, ws = fp8.quant_blocks(w)
        ws_t, ws_c = ws.transpose(1, 2).contiguous(), ws.contiguous()
        aq, a_s = fp8.quant_rows(x, rows=lay.rows, out_rows=Mp)
        t["quant padded x"] = ms(lambda: fp8.quant_rows(x, rows=lay.rows, out_rows=Mp))
        d = torch.empty(Mp, N, device="cuda", dtype=torch.bfloat16)
        t["dg fp8 fwd gemm"] = ms(lambda: dg.m_grouped_fp8_gemm_nt_contiguous(
            (aq, a_s.t()), (wqt, ws_t), d, lay.m_indices, disable_ue8m0_cast=True))
        ref = F.grouped_mm(x, w, offs=offs).float()
        err = ((deepgemm.unpad(d, lay).float() - ref).norm() / ref.norm()).item()
        t["unpad y"] = ms(lambda: deepgemm.unpad(d, lay))
        dq, d_s = fp8.quant_rows(dy, rows=lay.rows, out_rows=Mp)
        dx = torch.empty(Mp, K, device="cuda", dtype=torch.bfloat16)
        t["dg fp8 dgrad gemm"] = ms(lambda: dg.m_grouped_fp8_gemm_nt_contiguous(
            (dq, d_s.t()), (wq, ws_c), dx, lay.m_indices, disable_ue8m0_cast=True))
        xp = x.new_zeros(Mp, K).index_copy_(0, lay.rows, x)
        wt = w.transpose(1, 2).contiguous()
        t["dg bf16 fwd gemm"] = ms(lambda: dg.m_grouped_bf16_gemm_nt_contiguous(xp, wt, d, lay.m_indices))
        rows.append((model, which, M, Mp, K, N, t, err))
        print(f"{model} {which}: M {M} Mp {Mp} K {K} N {N} fwd err {err:.4f}: "
              + ", ".join(f"{k} {v:.3f}" for k, v in t.items()), flush=True)
    print("\nms (median of 20); ratios: bf16 GEMM / DeepGEMM path")
    for model, which, M, Mp, K, N, t, err in rows:
        fl = 2 * M * K * N / 1e9
        fwd = t["dg fp8 fwd gemm"] + t["quant padded x"]
        print(f"{model:17} {which}: bf16 fwd {t['bf16 fwd']:.3f} ({fl / t['bf16 fwd']:.0f} TF/s); dg fp8 gemm "
              f"{t['dg fp8 fwd gemm']:.3f} ({fl / t['dg fp8 fwd gemm']:.0f} TF/s real rows, {t['bf16 fwd'] / t['dg fp8 fwd gemm']:.2f}x), "
              f"+quant {t['bf16 fwd'] / fwd:.2f}x, +unpad +layout {t['bf16 fwd'] / (fwd + t['unpad y'] + t['layout']):.2f}x; "
              f"dgrad gemm {t['bf16 dgrad'] / t['dg fp8 dgrad gemm']:.2f}x; dg bf16 gemm {t['bf16 fwd'] / t['dg bf16 fwd gemm']:.2f}x")


if __name__ == "__main__":
    main()
