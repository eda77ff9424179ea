"""Causal attention on flash-attn-4 (PyPI `flash-attn-4`, module `flash_attn.cute`: CuTe DSL
kernels compiled at first call, Hopper and Blackwell): every family's plain case (GQA; DeepSeek's
MLA with d_qk != d_v), GPT-OSS's sliding window with learned sinks, which otherwise take
FlexAttention, and documents (packed sequences, data.document_mask) through the package's varlen
interface: the batch's tokens flattened to (T, H, d), each document a sequence of its own given by
`cu_seqlens` (int32 (N + 1,): the documents' starts, then T; common.document_starts).

The package's forward and backward are wrapped as two torch custom ops, `pithtrain::fa4_fwd` and
`pithtrain::fa4_bwd`, so the compiled attention modules (torch.compile with fullgraph=True) hold the
call as one opaque node whose autograd is the package's own backward. They take (B, S, H, d) views
(the package reads any layout whose last dimension is contiguous), as `common.attention` passes
them; the output is (B, S, H, d_v), the log-sum-exp (B, H, S) float32. With `cu_seqlens`: (T, H, d)
in, (T, H, d_v) and (H, T) out; `max_seqlen` bounds a document's length (the row length: the
kernels size their grids by the total, so no host read of the longest is needed).

`window` follows Hugging Face's convention (keys within the last `window` positions, the query's
own included: kj > qi - window), which is the package's local window (window - 1, 0); 0 means none.

A layer runs on it only where `TESTED` covers its attention (`covers`; common.use_kernels binds it
per layer): the kernels are compiled per head width and window kind, and a width no test ran is a
hope, not a kernel choice. A new shape is one more TESTED row, run on the GPU before it is used."""

from __future__ import annotations

from typing import Optional

import torch

try:  # optional: the appliance images install it (images/versions.yaml); CPU machines do not
    import flash_attn.cute.interface as _fa

    HAVE_FA4 = True
except ImportError:
    _fa = None
    HAVE_FA4 = False


# The head shapes tests/test_kernels_gpu.py::test_flash_attn_4_matches_eager runs (its cases come from
# here: forward and every gradient against the float64 reference, with and without documents):
# (heads, kv heads, d_qk, d_v, window or None, sinks).
TESTED = ((32, 4, 128, 128, None, False),  # Qwen3-30B-A3B: GQA
          (16, 16, 192, 128, None, False),  # DeepSeek-V2-Lite: MLA, d_qk != d_v
          (64, 8, 64, 64, None, True),  # GPT-OSS-20B full-attention layers: sinks
          (64, 8, 64, 64, 128, True))  # GPT-OSS-20B sliding layers: window 128 and sinks


def covers(shape: tuple) -> bool:
    """A layer's attention (its config's `attention_shapes(i)`: window or None, d_qk, d_v, heads) is
    at a TESTED shape: the same head widths (d_qk, d_v) and window kind (a window or none). The head
    counts are the kernels' grid, not their code, so they are not compared."""
    window, d_qk, d_v, _ = shape
    return any((d, e, w is None) == (d_qk, d_v, window is None) for _, _, d, e, w, _ in TESTED)


def _window(window: int) -> tuple[int | None, int | None]:
    return (None, None) if window <= 0 else (window - 1, 0)


def _varlen(cu_seqlens: Optional[torch.Tensor], max_seqlen: int) -> dict:
    if cu_seqlens is None:
        return {}
    return dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)


@torch.library.custom_op("pithtrain::fa4_fwd", mutates_args=(), device_types="cuda")
def fa4_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int,
            sinks: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], max_seqlen: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    left, right = _window(window)
    out, lse, *_ = _fa._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, window_size_left=left,
                                       window_size_right=right, learnable_sink=sinks, return_lse=True,
                                       **_varlen(cu_seqlens, max_seqlen))
    return out, lse


@fa4_fwd.register_fake
def _(q, k, v, scale, window, sinks, cu_seqlens, max_seqlen):
    if cu_seqlens is not None:  # (T, H, d)
        T, H, _ = q.shape
        return q.new_empty(T, H, v.shape[-1]), q.new_empty(H, T, dtype=torch.float32)
    B, S, H, _ = q.shape
    return q.new_empty(B, S, H, v.shape[-1]), q.new_empty(B, H, S, dtype=torch.float32)


@torch.library.custom_op("pithtrain::fa4_bwd", mutates_args=(), device_types="cuda")
def fa4_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, scale: float, window: int, sinks: Optional[torch.Tensor],
            cu_seqlens: Optional[torch.Tensor], max_seqlen: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and the sinks' gradient (float32; empty without sinks: an op returns tensors)."""
    left, right = _window(window)
    grads = _fa._flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, scale, True, 0.0, window_size_left=left,
                                window_size_right=right, learnable_sink=sinks, **_varlen(cu_seqlens, max_seqlen))
    dsink = grads[3].float() if sinks is not None else q.new_empty(0, dtype=torch.float32)
    return grads[0], grads[1], grads[2], dsink


@fa4_bwd.register_fake
def _(dout, q, k, v, out, lse, scale, window, sinks, cu_seqlens, max_seqlen):
    n = 0 if sinks is None else sinks.shape[0]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), q.new_empty(n, dtype=torch.float32)


def _setup(ctx, inputs, output):
    q, k, v, scale, window, sinks, cu_seqlens, max_seqlen = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], sinks, cu_seqlens)
    ctx.scale, ctx.window, ctx.max_seqlen = scale, window, max_seqlen
    ctx.set_materialize_grads(False)  # the log-sum-exp is an output for backward only


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, sinks, cu_seqlens = ctx.saved_tensors
    dq, dk, dv, dsink = fa4_bwd(dout, q, k, v, out, lse, ctx.scale, ctx.window, sinks, cu_seqlens, ctx.max_seqlen)
    return dq, dk, dv, None, None, None if sinks is None else dsink.to(sinks.dtype), None, None


fa4_fwd.register_autograd(_backward, setup_context=_setup)


def attention(q_BSHd, k_BSKd, v_BSKe, *, scale: float, window: int | None = None,
              sinks_H: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention (B, S, H, d_v) of (B, S, H|K, d) views; K divides H (GQA). With
    `cu_seqlens` (documents' starts over the B * S tokens, then B * S) each document attends
    within itself only: every row's first token starts a document."""
    if cu_seqlens is None:
        return fa4_fwd(q_BSHd, k_BSKd, v_BSKe, scale, window or 0, sinks_H, None, 0)[0]
    B, S = q_BSHd.shape[:2]
    flat = [t.reshape(B * S, *t.shape[2:]) for t in (q_BSHd, k_BSKd, v_BSKe)]  # a copy of a transposed view
    return fa4_fwd(*flat, scale, window or 0, sinks_H, cu_seqlens, S)[0].view(B, S, q_BSHd.shape[2], -1)
