"""DeepGEMM (deepseek-ai/DeepGEMM, images/build_deepgemm.sh) for the routed experts' grouped GEMMs.

  python -m pithtrain.kernels.deepgemm      # import + a tiny FP8 grouped GEMM: prints OK or why not

Optional and not wired into the models (the Triton kernels in fp8.py stay the GPU path): `load()`
gives the module or None, and `FP8GroupedMM` has fp8_linear.FP8GroupedMM's contract (rows sorted by
group, offs_G cumulative ends, w (G, K, N)) with DeepGEMM underneath:

  forward      y  = x w        m-grouped contiguous NT: x 1x128 scales, w^T (G, N, K) 128x128 blocks
  data grad    dx = dy w^T     the same GEMM on w (G, K, N): dy 1x128 scales
  weight grad  dw = x^T dy     k-grouped contiguous: x and dy with 128x1 scales along the tokens,
                               each group's block transposed (Hopper: K-major, `nt`; Blackwell: `tn`)

DeepGEMM's contiguous layouts want each group's rows padded to 128 (`ALIGN`): `plan` pads once per
forward (m_indices -1 on padding rows) and its padded x and dy are what the weight gradient reads.
The plan costs one host sync (the k-grouped API takes the group sizes as a host list). Quantisation
is pithtrain's Triton (fp8.quant_rows / quant_blocks / quant_tokens), not DeepGEMM's PyTorch casts.
Hopper: fp32 scales. Blackwell: power-of-2 (UE8M0) scales behind the same calls -- untested (no
B200 lent). `mgrouped_bf16` is DeepGEMM's bf16 m-grouped GEMM (SM90 only in this release).

Measured on the H200 (2026-12-01, scripts/device22.sh, issue #22): the pinned source builds in 87 s
and `load()` imports it and runs the smoke GEMM with no LD_PRELOAD (the libstdc++ promotion works).
Forward and data gradient match the bf16 reference on Qwen3's gate/up shape (rel. error 0.037);
the weight gradient does not (0.167), and the down-projection shape (K 768) ends in a CUDA error in
the weight-gradient GEMM. 2026-12-02 (scripts/deepgemm_kgrouped_probe.py): with DeepGEMM's own
generator the k-grouped GEMM is right on Qwen3's gate/up and both DeepSeek shapes, so the 0.167 is
in `kgrouped_fp8_wgrad` below (not found yet); m = 768 fails with DeepGEMM's generator too. Through
these wrappers the GEMMs ran at 196-225 TFLOP/s against torch's 564 (padding, the plan's host sync
and first-call JIT in the timing, not yet separated). So this stays unwired until #22 fixes both.
"""

from __future__ import annotations

import ctypes
import os
from typing import NamedTuple

import torch

from pithtrain.kernels import BLOCK, FP8, FP8_MAX, fp8_linear

ALIGN = BLOCK  # DeepGEMM's get_mk_alignment_for_contiguous_layout() (128 in v2.1.1)


def load(why: list | None = None):
    """The deep_gemm module, or None when it is not installed or fails to import (reason appended
    to `why`). The libstdc++ fix runs first: deep_gemm_cpp does not list libstdc++ as NEEDED and
    carries its own uninitialised copy of the std::ostream symbols; torch loads libstdc++ RTLD_LOCAL
    (torch/__init__.py: libtorch's C++ symbols must not clobber other libraries'), so the extension's
    references bound to its own copy and the first `<<` in deep_gemm_cpp.init segfaulted on the lent
    H200 (docs/perf-notes.md). Re-opening the already-loaded libstdc++ RTLD_GLOBAL puts it in the
    global scope, which the dynamic linker searches before the extension's own definitions (what
    LD_PRELOAD did). PITHTRAIN_LIBSTDCXX names another library file."""
    try:
        ctypes.CDLL(os.environ.get("PITHTRAIN_LIBSTDCXX", "libstdc++.so.6"), mode=os.RTLD_GLOBAL)
    except OSError as e:  # not Linux / glibc: deep_gemm will not load either, and says so below
        if why is not None:
            why.append(f"libstdc++ not promoted: {e}")
    try:
        import deep_gemm
        return deep_gemm
    except Exception as e:  # ImportError, or the extension's init failing (no CUDA, no nvcc)
        if why is not None:
            why.append(f"{type(e).__name__}: {e}")
        return None


def _ue8m0() -> bool:
    return torch.cuda.get_device_capability()[0] >= 10


# ---------------------------------------------------------------------------------------------
# Padding to DeepGEMM's contiguous layout (plain PyTorch: tested on the CPU)


class Plan(NamedTuple):
    rows: torch.Tensor        # (M,) int64: each input row's row in the padded layout
    m_indices: torch.Tensor   # (Mp,) int32: each padded row's group, -1 on padding rows
    ks: list                  # (G,) padded rows per group, multiples of ALIGN (host ints)
    ks_tensor: torch.Tensor   # (G,) int32, the same on the device
    tile_start: torch.Tensor  # (Mp / ALIGN,) int32: first padded row of each 128-row tile's group
    tile_len: torch.Tensor    # (Mp / ALIGN,) int32: that group's padded rows


def plan(offs_G: torch.Tensor, M: int) -> Plan:
    """The padded layout of M rows sorted by group (offs_G: cumulative ends, offs_G[-1] == M)."""
    ends = offs_G.long().tolist()  # the one host sync
    assert (ends[-1] if ends else 0) == M, "rows past offs[-1] belong to no group"
    starts = [0] + ends[:-1]
    counts = [e - s for s, e in zip(starts, ends)]
    ks = [-(-c // ALIGN) * ALIGN for c in counts]
    pad_starts = [sum(ks[:g]) for g in range(len(ks))]
    dev, Mp = offs_G.device, sum(ks)
    t = lambda v: torch.tensor(v, device=dev, dtype=torch.long)  # noqa: E731
    counts_t = t(counts)
    rows = torch.arange(M, device=dev) + torch.repeat_interleave(
        t([p - s for p, s in zip(pad_starts, starts)]), counts_t, output_size=M)
    m_indices = torch.full((Mp,), -1, device=dev, dtype=torch.int32)
    m_indices[rows] = torch.repeat_interleave(torch.arange(len(ks), device=dev), counts_t, output_size=M).int()
    tiles = t([k // ALIGN for k in ks])
    tile_start = torch.repeat_interleave(t(pad_starts), tiles, output_size=Mp // ALIGN).int()
    tile_len = torch.repeat_interleave(t(ks), tiles, output_size=Mp // ALIGN).int()
    return Plan(rows, m_indices, ks, t(ks).int(), tile_start, tile_len)


def pad(x: torch.Tensor, p: Plan) -> torch.Tensor:
    """(M, K) -> (Mp, K): rows moved to their padded places, zeros between groups."""
    return x.new_zeros(len(p.m_indices), x.shape[1]).index_copy_(0, p.rows, x)


def unpad(y: torch.Tensor, p: Plan) -> torch.Tensor:
    return y.index_select(0, p.rows)


def quant_tokens_reference(x: torch.Tensor, p: Plan, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quant_tokens in PyTorch: 128 x 1 scales along the rows of padded x (Mp, D) -> (q, s (Mp/128, D));
    q (Mp, D), or flat with each group's block transposed to (D, rows)."""
    Mp, D = x.shape
    xt = x.float().view(Mp // ALIGN, ALIGN, D)
    amax = xt.abs().amax(1, keepdim=True).clamp_min(1e-30)
    q = (xt * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(Mp, D)
    if transpose:
        starts = [sum(p.ks[:g]) for g in range(len(p.ks))]
        q = torch.cat([q[s:s + k].t().reshape(-1) for s, k in zip(starts, p.ks)] or [q.view(-1)])
    return q, (amax.squeeze(1) / FP8_MAX)


# ---------------------------------------------------------------------------------------------
# GEMMs (CUDA; dg = load())


def mgrouped_fp8(dg, a: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor, p: Plan) -> torch.Tensor:
    """d (Mp, N) bf16 = quant(a)[rows of g] @ deq(b[g])^T for padded a (Mp, K) bf16, b (G, N, K) e4m3
    with 128x128 scales b_s (G, N/128, K/128). Padding rows of d are garbage (unpad drops them)."""
    from pithtrain.kernels import fp8
    ue8m0 = _ue8m0()
    aq, a_s = fp8.quant_rows(a, ue8m0=ue8m0)  # a_s (K/128, Mp): its .t() is the MN-major layout DeepGEMM reads
    d = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=torch.bfloat16)
    dg.m_grouped_fp8_gemm_nt_contiguous((aq, a_s.t()), (b, b_s.contiguous()), d, p.m_indices,
                                        disable_ue8m0_cast=not ue8m0)
    return d


def kgrouped_fp8_wgrad(dg, x: torch.Tensor, dy: torch.Tensor, p: Plan) -> torch.Tensor:
    """dw (G, K, N) fp32 = x[rows of g]^T dy[rows of g] for padded x (Mp, K), dy (Mp, N), 128x1 scales."""
    from pithtrain.kernels import fp8
    ue8m0 = _ue8m0()
    d = torch.zeros(len(p.ks), x.shape[1], dy.shape[1], device=x.device, dtype=torch.float32)
    if not len(x):
        return d
    a, b = (fp8.quant_tokens(t, p.tile_start, p.tile_len, transpose=not ue8m0, ue8m0=ue8m0) for t in (x, dy))
    if ue8m0:  # Blackwell: MN-major operands (untested)
        dg.k_grouped_fp8_gemm_tn_contiguous(a, b, d, p.ks, p.ks_tensor, d)
    else:      # Hopper: per-group K-major blocks, MN-major scales
        dg.k_grouped_fp8_gemm_nt_contiguous((a[0], a[1].t()), (b[0], b[1].t()), d, p.ks, p.ks_tensor, d)
    return d


def mgrouped_bf16(dg, x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor,
                  p: Plan | None = None) -> torch.Tensor:
    """F.grouped_mm(x, w_GNK.mT, offs) through DeepGEMM's bf16 m-grouped GEMM (w K-major (G, N, K))."""
    p = p or plan(offs_G, len(x_MK))
    d = torch.empty(len(p.m_indices), w_GNK.shape[1], device=x_MK.device, dtype=torch.bfloat16)
    if len(d):
        dg.m_grouped_bf16_gemm_nt_contiguous(pad(x_MK, p), w_GNK, d, p.m_indices)
    return unpad(d, p)


class _DeepGEMMFP8(torch.autograd.Function):
    """y[rows of g] = x[rows of g] @ w[g] for w (G, K, N); the weight's FP8 copies come in."""

    @staticmethod
    def forward(ctx, dg, x_MK, w_GKN, offs_G, wq_GKN, wqt_GNK, ws_GKN):
        p = plan(offs_G, len(x_MK))
        x_pad = pad(x_MK, p)
        y = unpad(mgrouped_fp8(dg, x_pad, wqt_GNK, ws_GKN.transpose(1, 2), p), p) if len(x_MK) \
            else x_MK.new_zeros(0, w_GKN.shape[2])
        ctx.save_for_backward(x_pad, wq_GKN, ws_GKN)
        ctx.dg, ctx.plan, ctx.w_dtype = dg, p, w_GKN.dtype
        return y.to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        x_pad, wq_GKN, ws_GKN = ctx.saved_tensors
        p, dx, dw = ctx.plan, None, None
        dy_pad = pad(dy_MN.contiguous().to(x_pad.dtype), p)
        if ctx.needs_input_grad[1]:
            dx = unpad(mgrouped_fp8(ctx.dg, dy_pad, wq_GKN, ws_GKN, p), p).to(x_pad.dtype) if len(p.rows) \
                else x_pad.new_zeros(0, x_pad.shape[1])
        if ctx.needs_input_grad[2]:
            dw = kgrouped_fp8_wgrad(ctx.dg, x_pad, dy_pad, p).to(ctx.w_dtype)
        return None, dx, dw, None, None, None, None


class FP8GroupedMM(fp8_linear.FP8GroupedMM):
    """fp8_linear.FP8GroupedMM (its weight cache, its contract) with DeepGEMM's GEMMs; bf16 x."""

    def __init__(self, dg):
        from pithtrain.kernels import fp8
        ue8m0 = _ue8m0()
        self.cache = fp8_linear.WeightCache(quant=lambda w: fp8.quant_blocks(w, ue8m0=ue8m0))
        self.dg = dg

    def __call__(self, x_MK: torch.Tensor, w: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
        w_GKN = w.to_local() if hasattr(w, "to_local") else w
        wq, wqt, ws = self.cache.weights(w, w_GKN)
        with torch.autocast(x_MK.device.type, enabled=False):
            return _DeepGEMMFP8.apply(self.dg, x_MK, w_GKN, offs_G, wq, wqt, ws)


# ---------------------------------------------------------------------------------------------
# Smoke check (images/build_deepgemm.sh --check)


def _smoke() -> int:
    why: list = []
    dg = load(why)
    if dg is None:
        print("deepgemm: not loadable:", "; ".join(why))
        return 1
    print(f"deepgemm: {dg.__version__} from {os.path.dirname(dg.__file__)}")
    torch.manual_seed(0)
    G, K, N = 4, 256, 384
    offs = torch.tensor([100, 100, 356, 500], device="cuda", dtype=torch.int32)  # an empty group too
    x = torch.randn(500, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, K, N, device="cuda", dtype=torch.bfloat16)
    y = FP8GroupedMM(dg)(x, w, offs).float()
    ref = torch.nn.functional.grouped_mm(x, w, offs=offs).float()
    err = ((y - ref).norm() / ref.norm()).item()
    print(f"deepgemm smoke: FP8 m-grouped GEMM rel. error {err:.4f}", "OK" if err < 0.05 else "FAIL")
    return 0 if err < 0.05 else 1


if __name__ == "__main__":
    raise SystemExit(_smoke())
