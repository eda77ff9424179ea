"""Fused SwiGLU on the concatenated [gate | up] expert activations, forward and backward in Triton.

Reference: `pithtrain.models.common.swiglu` (tests/test_kernels_gpu.py compares the two).
Eager PyTorch runs 3 kernels forward (chunk views, silu, mul) and ~6 backward and keeps silu(gate)
alive for backward; this runs one kernel each way and saves only the input h (X, 2F).
Math in fp32, one rounding to the output dtype.

GPT-OSS's clamped variant (alpha, limit): g = min(gate, limit), u = clamp(up, -limit, limit),
y = g * sigmoid(alpha * g) * (u + 1). Gradients are zero where a clamp was active, as torch.clamp's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _block(F: int) -> tuple[int, int]:
    """(columns per program, warps): one program covers a whole row up to F = 4096."""
    b = min(triton.next_power_of_2(F), 4096)
    return b, 4 if b <= 1024 else 8


@triton.jit
def _swiglu_fwd(h_ptr, y_ptr, F, alpha, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(h_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        y = g * tl.sigmoid(alpha * g) * (u + 1.0)
    else:
        y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + row * F + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(h_ptr, dy_ptr, dh_ptr, F, alpha, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g0 = tl.load(h_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    u0 = tl.load(h_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * F + cols, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g0, limit)
        u = tl.minimum(tl.maximum(u0, -limit), limit)
        s = tl.sigmoid(alpha * g)
        dg = dy * (u + 1.0) * (s + alpha * g * s * (1.0 - s))
        dg = tl.where(g0 <= limit, dg, 0.0)
        du = dy * g * s
        du = tl.where((u0 >= -limit) & (u0 <= limit), du, 0.0)
    else:
        s = tl.sigmoid(g0)
        dg = dy * u0 * (s + g0 * s * (1.0 - s))
        du = dy * g0 * s
    tl.store(dh_ptr + row * 2 * F + cols, dg.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + row * 2 * F + F + cols, du.to(dh_ptr.dtype.element_ty), mask=mask)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_XF2, alpha, limit):
        h_XF2 = h_XF2.contiguous()
        X, F = h_XF2.shape[0], h_XF2.shape[1] // 2
        y_XF = h_XF2.new_empty(X, F)
        clamp = alpha is not None
        if X:
            b, w = _block(F)
            _swiglu_fwd[(X, triton.cdiv(F, b))](h_XF2, y_XF, F, float(alpha or 0.0), float(limit or 0.0),
                                                CLAMP=clamp, BLOCK=b, num_warps=w)
        ctx.save_for_backward(h_XF2)
        ctx.alpha, ctx.limit = alpha, limit
        return y_XF

    @staticmethod
    def backward(ctx, dy_XF):
        (h_XF2,) = ctx.saved_tensors
        X, F = h_XF2.shape[0], h_XF2.shape[1] // 2
        dh_XF2 = torch.empty_like(h_XF2)
        if X:
            b, w = _block(F)
            _swiglu_bwd[(X, triton.cdiv(F, b))](
                h_XF2, dy_XF.contiguous(), dh_XF2, F, float(ctx.alpha or 0.0),
                float(ctx.limit or 0.0), CLAMP=ctx.alpha is not None, BLOCK=b, num_warps=w)
        return dh_XF2, None, None


def swiglu(h_XF2: torch.Tensor, alpha: float | None = None, limit: float | None = None) -> torch.Tensor:
    """(X, 2F) [gate | up] -> (X, F); CUDA tensors only."""
    return _SwiGLU.apply(h_XF2, alpha, limit)
