"""Causal attention with a sliding window, learned sinks and/or documents through FlexAttention.

Reference: `common.eager_attention`, which materialises the (S, S) score matrix. FlexAttention
generates a block-sparse flash kernel from the mask: a 128-key window at S = 4096 visits ~2 of 32
key blocks per query block, and no score matrix ever exists in memory.

Sinks: GPT-OSS adds one learned logit per head to each softmax row, taking mass but contributing no
value. With lse = logsumexp of the real scores (FlexAttention returns it, differentiably),
softmax over [scores, sink] = softmax(scores) * exp(lse) / (exp(lse) + exp(sink)), so

    out = flex_out * sigmoid(lse - sink_h)

One `FlexAttention` per model (common.use_kernels) owns that model's block masks: causal / window
masks per (length, window, device), made once by `prepare` from eager code (the model's `rotary`
calls it before the layers), so compiled attention only reads them; document masks per batch.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

# Eager callers need the compiled kernel, not the reference; compiled code calls flex_attention
# itself. torch.compile wraps without compiling: nothing happens until the first call.
_compiled_flex = torch.compile(flex_attention, dynamic=False)


def _mask_mod(window):
    if window is None:
        def causal(b, h, q, k):
            return k <= q
        return causal

    def sliding(b, h, q, k):  # keys within the last `window` positions, Hugging Face's convention
        return (k <= q) & (k > q - window)
    return sliding


def _windows(windows, S):
    return {w if w is not None and w < S else None for w in windows}


class FlexAttention:
    """One model's FlexAttention: `windows` are its layers' windows (None: full causal)."""

    def __init__(self, windows):
        self.windows = set(windows)
        self.masks: dict = {}  # (S, window, device) -> BlockMask

    def block_mask(self, S: int, window: int | None, device):
        key = (S, window, str(device))
        if key not in self.masks:
            self.masks[key] = create_block_mask(_mask_mod(window), B=None, H=None, Q_LEN=S, KV_LEN=S,
                                                device=device)
        return self.masks[key]

    def prepare(self, S: int, device):
        for w in _windows(self.windows, S):
            self.block_mask(S, w, device)

    def document_masks(self, docs_BS: torch.Tensor) -> dict:
        """window -> BlockMask of causal (windowed) attention within each row's documents (document
        masking; docs_BS the document index per token). Built per batch, in eager code."""
        B, S = docs_BS.shape
        masks = {}
        for w in _windows(self.windows, S):
            inner = _mask_mod(w)

            def same_doc(b, h, q, k, inner=inner):
                return inner(b, h, q, k) & (docs_BS[b, q] == docs_BS[b, k])
            masks[w] = create_block_mask(same_doc, B=B, H=None, Q_LEN=S, KV_LEN=S, device=docs_BS.device)
        return masks

    def __call__(self, q_BHSd, k_BKSd, v_BKSe, *, scale: float, window: int | None = None,
                 sinks_H: torch.Tensor | None = None, doc_mask=None):
        """doc_mask: a document mask (document_masks); None: the cached causal / window mask."""
        S = q_BHSd.shape[2]
        mask = doc_mask
        if mask is None:
            mask = self.block_mask(S, window if window is not None and window < S else None, q_BHSd.device)
        gqa = k_BKSd.shape[1] != q_BHSd.shape[1]
        fn = flex_attention if torch.compiler.is_compiling() else _compiled_flex
        if sinks_H is None:
            return fn(q_BHSd, k_BKSd, v_BKSe, block_mask=mask, scale=scale, enable_gqa=gqa)
        out, aux = fn(q_BHSd, k_BKSd, v_BKSe, block_mask=mask, scale=scale, enable_gqa=gqa,
                      return_aux=AuxRequest(lse=True))
        w_BHS = torch.sigmoid(aux.lse.float() - sinks_H.float()[None, :, None])
        return out * w_BHS[..., None].to(out.dtype)
