"""Cross-entropy over a chunk of bf16 logits, writing d(sum CE)/d(logits) over them in place (Triton).

Used by kernels/linear_ce.py on CUDA. One program per row: pass 1 streams the row once with an
online max / sum (fp32) for the log-sum-exp and picks the target logit; pass 2 streams it again and
overwrites it with softmax - onehot (0 on ignored rows, label -100). PyTorch's version of the same
(float copy, logsumexp, sub, exp, scatter, mul, cast) makes ~8 passes over an fp32 (rows, V) tensor;
measured 2026-11-29 on the H200 at ~35 ms of a 110 ms Qwen3-4L step (docs/perf-notes.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ce_rows(logits_ptr, labels_ptr, loss_ptr, stride, V: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    label = tl.load(labels_ptr + row).to(tl.int64)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    valid = label != -100
    safe = tl.where(valid, label, 0)
    picked = tl.load(base + safe).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(cols == safe, 1.0, 0.0)
        g = tl.where(valid, g, 0.0)
        tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=cols < V)


def ce_rows_inplace(logits_cV: torch.Tensor, labels_c: torch.Tensor) -> torch.Tensor:
    """Per-row loss (fp32, 0 where label == -100); logits are replaced by their gradient."""
    c, V = logits_cV.shape
    assert logits_cV.stride(1) == 1
    loss = torch.empty(c, dtype=torch.float32, device=logits_cV.device)
    if c:
        _ce_rows[(c,)](logits_cV, labels_c, loss, logits_cV.stride(0), V=V, BLOCK=4096, num_warps=8)
    return loss
