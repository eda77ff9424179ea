"""Token permute / weighted unpermute for the MoE layer as gathers (Triton), forward and backward.

Reference: `LocalDispatcher` in models/common.py, which gathers rows forward and scatter-adds back
(`index_add`: bf16 atomics, a nondeterministic sum). Here every sum is a gather: with
order_X (the stable sort of the T*A routed slots by expert) and its inverse inv_TA
(inv_TA[t, a] = the row of slot (t, a) in expert order),

    permute:    x_XD[i]  = x_TD[order_X[i] // A]                          (index_select)
      backward: dx_TD[t] = sum_a dx_XD[inv_TA[t, a]]                       (gather-sum)
    unpermute:  y_TD[t]  = sum_a w_TA[t, a] * y_XD[inv_TA[t, a]]           (gather-sum, fp32 accumulate)
      backward: dy_XD[i] = w[order_X[i]] * dy_TD[order_X[i] // A]          (gather-sum of one row)
                dw_TA[t, a] = <dy_TD[t], y_XD[inv_TA[t, a]]>               (gather-dot)

so results are deterministic and each output row is written once. A slot the experts do not
compute (LocalDispatcher(drops=True)) has no row: order_X holds only the computed slots and its
inv_TA is -1, which the gathers skip (its term is 0, its weight gradient 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_sum(src_ptr, idx_ptr, w_ptr, out_ptr, D, A: tl.constexpr, HAS_W: tl.constexpr,
                BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for a in tl.static_range(A):
        i = tl.load(idx_ptr + t * A + a).to(tl.int64)
        row = tl.load(src_ptr + i * D + cols, mask=mask & (i >= 0), other=0.0).to(tl.float32)
        if HAS_W:
            row = row * tl.load(w_ptr + t * A + a).to(tl.float32)
        acc += row
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_dot(g_ptr, src_ptr, idx_ptr, out_ptr, D, A: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    g = tl.load(g_ptr + t * D + cols, mask=mask, other=0.0).to(tl.float32)
    for a in tl.static_range(A):
        i = tl.load(idx_ptr + t * A + a).to(tl.int64)
        row = tl.load(src_ptr + i * D + cols, mask=mask & (i >= 0), other=0.0).to(tl.float32)
        tl.store(out_ptr + t * A + a, tl.sum(g * row, axis=0).to(out_ptr.dtype.element_ty))


def gather_sum(src_XD, idx_TA, w_TA=None):
    """out[t] = sum_a (w[t, a] *) src[idx[t, a]] over idx >= 0, fp32 accumulation."""
    T, A = idx_TA.shape
    D = src_XD.shape[1]
    out = src_XD.new_empty(T, D)
    if T:
        b = min(triton.next_power_of_2(D), 2048)
        _gather_sum[(T, triton.cdiv(D, b))](src_XD, idx_TA, w_TA if w_TA is not None else idx_TA, out,
                                            D, A, HAS_W=w_TA is not None, BLOCK=b,
                                            num_warps=4 if b <= 1024 else 8)
    return out


def gather_dot(g_TD, src_XD, idx_TA, dtype):
    T, A = idx_TA.shape
    D = g_TD.shape[1]
    out = torch.empty(T, A, dtype=dtype, device=g_TD.device)
    if T:
        b = triton.next_power_of_2(D)
        _gather_dot[(T,)](g_TD, src_XD, idx_TA, out, D, A, BLOCK=b, num_warps=4 if b <= 2048 else 8)
    return out


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, order_X, inv_TA):
        ctx.save_for_backward(inv_TA)
        return x_TD.index_select(0, order_X // inv_TA.shape[1])

    @staticmethod
    def backward(ctx, g_XD):
        (inv_TA,) = ctx.saved_tensors
        return gather_sum(g_XD.contiguous(), inv_TA), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_XD, w_TA, order_X, inv_TA):
        y_XD, w_TA = y_XD.contiguous(), w_TA.contiguous()
        ctx.save_for_backward(y_XD, w_TA, order_X, inv_TA)
        return gather_sum(y_XD, inv_TA, w_TA)

    @staticmethod
    def backward(ctx, g_TD):
        y_XD, w_TA, order_X, inv_TA = ctx.saved_tensors
        g_TD = g_TD.contiguous()
        A = inv_TA.shape[1]  # one source row per output row, scaled by its weight (in g's dtype, as w * g)
        dy_XD = gather_sum(g_TD, (order_X // A)[:, None], w_TA.reshape(-1)[order_X].to(g_TD.dtype)[:, None])
        dw_TA = gather_dot(g_TD, y_XD, inv_TA, w_TA.dtype) if ctx.needs_input_grad[1] else None
        return dy_XD, dw_TA, None, None


def permute(x_TD, order_X, inv_TA):
    """Rows of x in expert order (each token once per routed slot); CUDA tensors only."""
    return _Permute.apply(x_TD, order_X, inv_TA)


def unpermute(y_XD, w_TA, order_X, inv_TA):
    """Weighted sum of each token's expert outputs back in token order; CUDA tensors only."""
    return _Unpermute.apply(y_XD, w_TA, order_X, inv_TA)
