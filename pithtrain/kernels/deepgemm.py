"""DeepGEMM (deepseek-ai/DeepGEMM, built by images/build_deepgemm.sh) for the routed experts' FP8 GEMMs.

  python -m pithtrain.kernels.deepgemm      # import + a tiny FP8 grouped GEMM: prints OK or why not

`train.fp8: true` on a Hopper GPU with deep_gemm installed gives each experts module an
`FP8GroupedMM` below (kernels.configure's `deepgemm`; `no-deepgemm` in the bench, or no deep_gemm:
fp8_linear's Triton kernels). The contract is fp8_linear.FP8GroupedMM's (rows sorted by group,
offs_G cumulative ends, w (G, K, N), the same per-step weight cache):

  forward      y  = x w        DeepGEMM m-grouped contiguous FP8 GEMM: x 1x128 scales, w^T (G, N, K)
                               in 128x128 blocks
  data grad    dx = dy w^T     the same GEMM on w (G, K, N): dy 1x128 scales
  weight grad  dw = x^T dy     bf16 from the saved activations (wgrad.accumulate in place where
                               kernels.configure's `wgrad` is on, else torch's grouped_mm): DeepGEMM's
                               k-grouped FP8 GEMM measured 2.5x slower than bf16 at these shapes,
                               quantisation included, and wrong at 1-127 rows per expert

DeepGEMM's contiguous layout wants each group's rows to start on a multiple of 128 (`ALIGN`).
`layout` places the rows on the device without reading anything back to the host: the padded row
count is the bound M + G * 127 (rounded to 128), and the tiles past the last group are marked -1,
which DeepGEMM skips. The activation quantisation (fp8.quant_rows with `rows`) writes each row
straight into its padded place, and the output rows are gathered back (`unpad`); padding rows are
never read. Blackwell (power-of-2 UE8M0 scales, the same calls): coded, untested (no B200 lent).

`ops`: the same maths in PyTorch (`REFERENCE`: dequantise, per-group fp32 products) for CPU
tensors, so the layout and the autograd logic are tested in CI; the GPU tests compare the two.

Measured on the lent H200 (docs/perf-notes.md, DeepGEMM section, issue #22): v2.1.1.post3 with three
upstream fixes (images/versions.yaml deepgemm_patches) builds in ~60 s; GEMM alone at the bench's
expert shapes 1.67-1.86x torch's bf16 grouped_mm (forward), 1.58-1.83x (data grad).
"""

from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace
from typing import NamedTuple

import torch

from pithtrain.kernels import BLOCK, fp8_linear, wgrad

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
    why = [] if why is None else why
    try:
        ctypes.CDLL(os.environ.get("PITHTRAIN_LIBSTDCXX", "libstdc++.so.6"), mode=os.RTLD_GLOBAL)
    except OSError as e:  # not Linux / glibc: deep_gemm will not load either, and says so below
        why.append(f"libstdc++ not promoted: {e}")
    try:
        import deep_gemm
        return deep_gemm
    except Exception as e:  # ImportError, or the extension's init failing (no CUDA, no nvcc)
        why.append(f"{type(e).__name__}: {e}")
        return None


# ---------------------------------------------------------------------------------------------
# The padded contiguous layout, on the device (plain PyTorch: tested on the CPU)


class Layout(NamedTuple):
    rows: torch.Tensor       # (M,) int64: each row's row in the padded layout
    m_indices: torch.Tensor  # (Mp,) int32: each padded row's group, -1 on padding rows


def padded_rows(M: int, G: int) -> int:
    """The padded row count for M rows in G groups, whatever their sizes: each group pads at most
    ALIGN - 1 rows. A host integer from host integers: no device read."""
    return -(-(M + G * (ALIGN - 1)) // ALIGN) * ALIGN if M else 0


def layout(offs_G: torch.Tensor, M: int) -> Layout:
    """Where M rows sorted by group (offs_G: cumulative ends, offs_G[-1] == M) go when each group
    starts on a multiple of ALIGN. Device work only (no host synchronisation): one Triton kernel on
    CUDA (fp8.padded_layout), the same in PyTorch elsewhere."""
    dev, G = offs_G.device, len(offs_G)
    m_indices = torch.full((padded_rows(M, G),), -1, device=dev, dtype=torch.int32)
    if offs_G.is_cuda and M:
        from pithtrain.kernels import fp8
        return Layout(fp8.padded_layout(offs_G, M, m_indices, ALIGN), m_indices)
    ends = offs_G.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    shift = torch.cumsum(padded, 0) - padded - (ends - counts)  # padded start - start, per group
    arange = torch.arange(M, device=dev)
    group_M = torch.searchsorted(ends, arange, right=True)
    rows = arange + shift[group_M.clamp(max=max(G - 1, 0))] if G else arange
    m_indices[rows] = group_M.to(torch.int32)
    return Layout(rows, m_indices)


def unpad(y: torch.Tensor, lay: Layout) -> torch.Tensor:
    return y.index_select(0, lay.rows)


# ---------------------------------------------------------------------------------------------
# Operators: DeepGEMM + Triton on CUDA, the same contracts in PyTorch for the tests


def _ue8m0(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 10


def _quant_padded_ref(x: torch.Tensor, rows: torch.Tensor, Mp: int, ue8m0: bool = False):
    q, s = fp8_linear.quant_rows(x)
    qp = q.new_zeros(Mp, q.shape[1])
    qp.view(torch.uint8).index_copy_(0, rows, q.view(torch.uint8))  # no index_copy_ for fp8 on the CPU
    return qp, s.new_ones(s.shape[0], Mp).index_copy_(1, rows, s)


def _mgrouped_ref(a, a_s, b, b_s, m_indices, out):
    """out[r] = deq(a)[r] @ deq(b[m_indices[r]])^T for rows with a group (DeepGEMM's contract:
    b (G, N, K), b_s (G, N/128, K/128)); padding rows left as they are."""
    A = fp8_linear.dequant_rows(a, a_s)
    B = fp8_linear.dequant_blocks(b, b_s)
    for g in range(len(b)):
        sel = (m_indices == g).nonzero().squeeze(1)
        out[sel] = (A[sel] @ B[g].t()).to(out.dtype)


REFERENCE = SimpleNamespace(quant_padded=_quant_padded_ref, mgrouped=_mgrouped_ref)


def _cuda_ops(dg):
    from pithtrain.kernels import fp8

    def quant_padded(x, rows, Mp, ue8m0=False):
        return fp8.quant_rows(x, ue8m0=ue8m0, rows=rows, out_rows=Mp)

    def mgrouped(a, a_s, b, b_s, m_indices, out):
        # a_s (K/128, Mp): its transpose is the MN-major layout DeepGEMM reads, without a copy.
        dg.m_grouped_fp8_gemm_nt_contiguous((a, a_s.t()), (b, b_s), out, m_indices,
                                            disable_ue8m0_cast=not _ue8m0(a))
    return SimpleNamespace(quant_padded=quant_padded, mgrouped=mgrouped)


def _gemm(ops, x_MK, b_GNK, bs_GNK, lay: Layout) -> torch.Tensor:
    """y (M, N) = x[rows of g] @ deq(b[g])^T, through the padded layout."""
    M, N = len(x_MK), b_GNK.shape[1]
    if M == 0:
        return x_MK.new_zeros(0, N)
    Mp = len(lay.m_indices)
    aq, a_s = ops.quant_padded(x_MK, lay.rows, Mp, _ue8m0(x_MK))
    out = torch.empty(Mp, N, device=x_MK.device, dtype=torch.bfloat16 if x_MK.is_cuda else x_MK.dtype)
    ops.mgrouped(aq, a_s, b_GNK, bs_GNK, lay.m_indices, out)
    return unpad(out, lay).to(x_MK.dtype)


class _DeepGEMMFP8(torch.autograd.Function):
    """y[rows of g] = x[rows of g] @ w[g] for w (G, K, N); the weight's FP8 copies come in. `param`
    (in a tuple, not an autograd input): the parameter whose gradient wgrad.target may write, and
    the run's WeightCopies."""

    @staticmethod
    def forward(ctx, ops, lay, x_MK, w_GKN, offs_G, wq_GKN, wqt_GNK, ws_GKN, wst_GNK, param):
        ctx.save_for_backward(x_MK, offs_G, wq_GKN, ws_GKN)  # before the GEMM: as fp8_linear's
        ctx.ops, ctx.lay, ctx.w_dtype, ctx.G = ops, lay, w_GKN.dtype, len(w_GKN)
        # In place (param given, x and w views made for this call, as wgrad's _GroupedMM): which
        # gradients this backward wants (the pipeline's input-only and weight-only passes).
        ctx.w, ctx.copies = param if param else (None, None)
        ctx.x_node, ctx.nodes = None, (None, None)
        if ctx.w is not None:
            ctx.x_node = wgrad.grad_nodes(x_MK, ctx.w)[0]
            ctx.nodes = wgrad.grad_nodes(w_GKN, ctx.w)
        return _gemm(ops, x_MK, wqt_GNK, wst_GNK, lay)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, offs_G, wq_GKN, ws_GKN = ctx.saved_tensors
        dy_MN = dy_MN.contiguous().to(x_MK.dtype)
        dx = dw = None
        if ctx.needs_input_grad[2] and (ctx.x_node is None or wgrad.will_run(ctx.x_node)):
            dx = _gemm(ctx.ops, dy_MN, wq_GKN, ws_GKN, ctx.lay)
        w_node, acc_node = ctx.nodes
        if ctx.needs_input_grad[3] and (w_node is None or wgrad.will_run(w_node)):
            g, fresh = wgrad.target(ctx.w, acc_node, ctx.copies) if ctx.w is not None else (None, False)
            if g is None:
                dw = fp8_linear.weight_grad(x_MK, dy_MN, offs_G, ctx.G).to(ctx.w_dtype)
            else:
                wgrad.accumulate(g, x_MK, dy_MN, offs_G, add=not fresh)
                wgrad.count(ctx.w, ctx.copies)
        return None, None, dx, dw, None, None, None, None, None, None


class FP8GroupedMM(fp8_linear.FP8GroupedMM):
    """fp8_linear.FP8GroupedMM (its weight cache, its contract) on DeepGEMM. `dg`: the deep_gemm
    module (None: the PyTorch reference, for CPU tensors); `in_place`: the weight gradient
    accumulates in place (kernels.configure's `wgrad`) where wgrad.target allows it, into the master
    of a bf16 copy where `copies` (the run's precision.WeightCopies) has one."""

    def __init__(self, dg=None, in_place: bool = False, copies=None):
        self.ops = _cuda_ops(dg) if dg is not None else REFERENCE

        def quant(w):  # q (G, K, N), q^T (G, N, K), scales in both layouts (made once per step)
            if dg is None:
                q, qt, s = fp8_linear.quant_blocks(w)
            else:
                from pithtrain.kernels import fp8
                q, qt, s = fp8.quant_blocks(w, ue8m0=_ue8m0(w))
            return q, qt, s.contiguous(), s.transpose(1, 2).contiguous()
        self.cache = fp8_linear.WeightCache(quant=quant)
        self.in_place, self.copies = in_place, copies
        self._layout = None  # (offs, its version, M, Layout) of the last call

    def layout(self, offs_G: torch.Tensor, M: int) -> Layout:
        """The layout of this call's rows; the layer's second GEMM (the same offs tensor, unchanged
        since: its version counter) reuses the first's."""
        key = (offs_G, offs_G._version, M)
        last = self._layout
        if last is None or last[0] is not offs_G or last[1:3] != key[1:]:
            last = self._layout = (*key, layout(offs_G, M))
        return last[3]

    def __call__(self, x_MK: torch.Tensor, w: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
        w_GKN = w.to_local() if hasattr(w, "to_local") else w
        wq, wqt, ws, wst = self.cache.weights(w, w_GKN)
        param = ()
        if (self.in_place and torch.is_grad_enabled() and type(w) is torch.nn.Parameter
                and w_GKN.dtype == x_MK.dtype and all(n % 8 == 0 for n in w_GKN.shape[1:])):
            param = (w, self.copies)  # views made for this call: their nodes are never leaves
            x_MK, w_GKN = x_MK.contiguous().view_as(x_MK), w_GKN.view_as(w_GKN)
        with torch.autocast(x_MK.device.type, enabled=False):
            offs_G = offs_G.to(torch.int32)
            return _DeepGEMMFP8.apply(self.ops, self.layout(offs_G, len(x_MK)), x_MK, w_GKN, offs_G, wq, wqt, ws, wst,
                                      param)


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
