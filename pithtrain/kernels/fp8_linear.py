"""Blockwise FP8 training GEMMs (e4m3, DeepSeek-V3's scaling) and the per-step FP8 weight cache.

`train.fp8: true` (CUDA, compute capability >= 8.9, Triton, train.kernels=auto) gives each routed
experts module (common.GroupedExperts) an `FP8GroupedMM` below as its grouped GEMM (`mm`). Master weights,
gradients and AdamW state keep their dtype: only GEMM operands are FP8, each GEMM accumulates in
fp32 and writes in its input's dtype (bf16: GroupedExperts casts to the autocast dtype). The
router, embeddings, norms, attention, the dense projections and the LM head stay bf16
(DeepSeek-V3 keeps the first four and the head); on the lent H200 the dense FP8 GEMMs measured
are no faster at the attention projections' sizes (docs/perf-notes.md).

  forward      y  = x w          x: 1x128 tiles,  w: 128x128 blocks (from the weight cache)
  data grad    dx = dy w^T       dy: 1x128 tiles, w: the same blocks (both layouts are cached:
                                 the GEMM reads its weight K-contiguous)
  weight grad  dw = x^T dy       bf16, from the saved bf16 activations: at the routed experts'
                                 shapes (a few hundred rows per expert per micro-batch) quantising
                                 x and dy along the tokens cost more than an FP8 GEMM saves; the
                                 FP8 version measured 2.6x slower than bf16 (docs/perf-notes.md)

Operators: Triton (`kernels/fp8.py`) for CUDA tensors; the functions below are the same
maths in plain PyTorch (dequantise, fp32 matmul): the tests' reference, and what CPU tensors run,
so the autograd and cache logic is tested in CI. Recipes with train.fp8 on a CPU are refused
(build.check_run). On Hopper with deep_gemm installed kernels/deepgemm.py's FP8GroupedMM (this
class's contract and cache, DeepGEMM's GEMMs) takes over; Blackwell's MXFP8 is not wired (no B200 is
lent).

Weight cache: each `FP8GroupedMM` (one per experts module) quantises a weight at most once per
optimizer step (`next_step(model)`, called by the trainer after `optimizer.step()`, drops every
copy) and also re-quantises when the tensor was written in place since or moved (version counters,
storage pointer). `quantised(model)` counts the model's quantisations (the bench shows one per
weight per step).
Under FSDP the cache holds the unsharded FP8 copies (q and q^T, 2 bytes per element) of every
expert weight for the whole step: memory the sharding otherwise saves (FSDP + FP8 is untested).
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import torch

from pithtrain.kernels import BLOCK, FP8, FP8_MAX

# ---------------------------------------------------------------------------------------------
# Reference operators (PyTorch): the same contracts as kernels/fp8.py (whose FP8 tensors
# are views of storage padded to 16-byte rows; these are contiguous).


def _pad_to(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x with zeros appended along `dim` up to a multiple of BLOCK (x itself, not a copy, if it is one)."""
    if x.shape[dim] % BLOCK == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, -x.shape[dim] % BLOCK]
    return torch.nn.functional.pad(x, pad)


def _to_fp8(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    return (x * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (q (M, K) e4m3, s (cdiv(K, 128), M) fp32): value = q * s, 1 x 128 tiles along K."""
    M, K = x.shape
    xp = _pad_to(x.float(), 1)
    xp = xp.reshape(M, xp.shape[1] // BLOCK, BLOCK)
    amax = xp.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    q = _to_fp8(xp, amax).view(M, xp.shape[1] * BLOCK)[:, :K]
    return q.contiguous(), (amax.squeeze(-1) / FP8_MAX).t().contiguous()


def quant_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(G, R, C) -> (q (G, R, C), q^T (G, C, R) e4m3, s (G, cdiv(R, 128), cdiv(C, 128)) fp32)."""
    G, R, C = w.shape
    wp = _pad_to(_pad_to(w.float(), 1), 2)
    blocks = wp.view(G, wp.shape[1] // BLOCK, BLOCK, wp.shape[2] // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(2, 4), keepdim=True).clamp_min(1e-30)
    q = _to_fp8(blocks, amax).view(G, wp.shape[1], wp.shape[2])[:, :R, :C]
    return q.contiguous(), q.transpose(1, 2).contiguous(), (amax[:, :, 0, :, 0] / FP8_MAX).contiguous()


def dequant_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Inverse of quant_rows in fp32: (M, K) values."""
    return q.float() * s.t().repeat_interleave(BLOCK, 1)[:, :q.shape[1]]


def dequant_blocks(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Inverse of quant_blocks' first output in fp32: (G, R, C) values; s may be a transposed view."""
    R, C = q.shape[1:]
    return q.float() * s.repeat_interleave(BLOCK, 1)[:, :R].repeat_interleave(BLOCK, 2)[:, :, :C]


def mgrouped_mm(a, a_s, b, b_s, offs, out_dtype=torch.bfloat16):
    """out[rows of g] = deq(a)[rows of g] @ deq(b[g])^T; b (G, N, K) with b_s indexed (g, k block,
    n block) -- kernels/fp8.py mgrouped_mm's contract, in fp32."""
    A = dequant_rows(a, a_s)
    B = dequant_blocks(b, b_s.transpose(1, 2))  # (G, N, K)
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    ends = offs.tolist()
    for g, (start, end) in enumerate(zip([0, *ends], ends)):
        out[start:end] = (A[start:end] @ B[g].t()).to(out_dtype)
    return out


REFERENCE = SimpleNamespace(quant_rows=quant_rows, quant_blocks=quant_blocks, mgrouped_mm=mgrouped_mm)


def _ops(t: torch.Tensor):
    """The Triton kernels for CUDA tensors, the PyTorch reference above for anything else."""
    if t.is_cuda:
        from pithtrain.kernels import fp8 as triton_fp8
        return triton_fp8
    return REFERENCE


# ---------------------------------------------------------------------------------------------
# Weight cache


class WeightCache:
    """FP8 copies (q, q^T, block scales) of weights, made once per optimizer step."""

    def __init__(self, quant=None):
        self.quantised = 0
        self.quant = quant  # quant_blocks' contract; None: Triton on CUDA, the reference otherwise
        self._entries: dict[int, tuple] = {}

    def next_step(self) -> None:
        """The optimizer has changed the weights: every cached copy is stale."""
        self._entries.clear()

    def weights(self, owner: torch.Tensor, w_GRC: torch.Tensor):
        """(q, q^T, s) of w_GRC, a (G, R, C) view of the parameter `owner` (the cache key)."""
        # Fresh (next_step has not dropped it): the same parameter, no in-place write since through
        # either tensor (a DTensor's to_local() view has its own version counter), the same storage.
        stamp = (owner._version, w_GRC._version, w_GRC.data_ptr())
        e = self._entries.get(id(owner))
        if e is not None and e[0]() is owner and e[1] == stamp:
            return e[2]
        with torch.no_grad():
            value = (self.quant or _ops(w_GRC).quant_blocks)(w_GRC.detach())
        key = id(owner)  # the copies go with their parameter (e.g. a precision.WeightCopies leaf)
        self._entries[key] = (weakref.ref(owner, lambda ref: self._forget(key, ref)), stamp, value)
        self.quantised += 1
        return value

    def _forget(self, key: int, ref) -> None:
        if (e := self._entries.get(key)) is not None and e[0] is ref:
            del self._entries[key]


def caches(model: torch.nn.Module) -> list[WeightCache]:
    """The weight caches of the model's FP8 experts modules (none without train.fp8)."""
    return [m.mm.cache for m in model.modules() if isinstance(getattr(m, "mm", None), FP8GroupedMM)]


def next_step(model: torch.nn.Module) -> None:
    """After optimizer.step(): the weights changed, FP8 copies are made again on first use."""
    for c in caches(model):
        c.next_step()


def quantised(model: torch.nn.Module) -> int:
    """Weight quantisations so far in the model (the witness that the cache works)."""
    return sum(c.quantised for c in caches(model))


# ---------------------------------------------------------------------------------------------
# Autograd


class _FP8GroupedMM(torch.autograd.Function):
    """y[rows of g] = x[rows of g] @ w[g] for w (G, K, N); the weight's FP8 copies come in."""

    @staticmethod
    def forward(ctx, x_MK, w_GKN, offs_G, wq_GKN, wqt_GNK, ws_GKN):
        # Saved before the GEMM runs: activation checkpointing's "cheap" recompute stops at the
        # last save (pithtrain/compile.py), so this GEMM is not run again.
        ctx.save_for_backward(x_MK, offs_G, wq_GKN, ws_GKN)
        ctx.w_dtype = w_GKN.dtype
        ops = _ops(x_MK)
        xq, xs = ops.quant_rows(x_MK)
        return ops.mgrouped_mm(xq, xs, wqt_GNK, ws_GKN, offs_G, out_dtype=x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, offs_G, wq_GKN, ws_GKN = ctx.saved_tensors
        ops = _ops(dy_MN)
        dy_MN = dy_MN.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dyq, dys = ops.quant_rows(dy_MN)
            dx = ops.mgrouped_mm(dyq, dys, wq_GKN, ws_GKN.transpose(1, 2), offs_G, out_dtype=x_MK.dtype)
        if ctx.needs_input_grad[1]:
            dw = weight_grad(x_MK, dy_MN, offs_G, len(wq_GKN)).to(ctx.w_dtype)
        return dx, dw, None, None, None, None


def weight_grad(x_MK, dy_MN, offs_G, G):
    """dw[g] = x[rows of g]^T dy[rows of g] in the activations' precision (bf16 on the GPU)."""
    if x_MK.is_cuda and x_MK.dtype == dy_MN.dtype == torch.bfloat16 and len(x_MK):
        return torch.nn.functional.grouped_mm(x_MK.t(), dy_MN, offs=offs_G)
    dw = x_MK.new_zeros(G, x_MK.shape[1], dy_MN.shape[1])
    ends = offs_G.tolist()
    for g, (start, end) in enumerate(zip([0, *ends], ends)):
        dw[g] = x_MK[start:end].t() @ dy_MN[start:end].to(x_MK.dtype)
    return dw


class FP8GroupedMM:
    """An experts module's grouped GEMM in FP8 (its `mm`), with that module's weight cache:
    FP8 version of F.grouped_mm(x, w, offs) for rows sorted by group (offs: cumulative ends,
    offs[-1] = rows); w: the parameter (a DTensor under expert parallel: its local block is used,
    the parameter keys the cache). The output is in x's dtype; autocast is off inside
    (GroupedExperts casts x to its dtype first), so the PyTorch reference's fp32 products stay fp32."""

    def __init__(self):
        self.cache = WeightCache()

    def __call__(self, x_MK: torch.Tensor, w: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
        w_GKN = w.to_local() if hasattr(w, "to_local") else w
        wq, wqt, ws = self.cache.weights(w, w_GKN)
        with torch.autocast(x_MK.device.type, enabled=False):
            return _FP8GroupedMM.apply(x_MK, w_GKN, offs_G.to(torch.int32), wq, wqt, ws)
