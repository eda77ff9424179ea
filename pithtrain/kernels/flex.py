"""Causal attention with a sliding window and/or learned sinks through FlexAttention (GPT-OSS).

Reference: `common.eager_attention`, which materialises the (S, S) score matrix. FlexAttention
generates a block-sparse flash kernel from the mask: a 128-key window at S = 4096 visits ~2 of 32
key blocks per query block, and no score matrix ever exists in memory.

Sinks: GPT-OSS adds one learned logit per head to each softmax row, taking mass but contributing no
value. With lse = logsumexp of the real scores (FlexAttention returns it, differentiably),
softmax over [scores, sink] = softmax(scores) * exp(lse) / (exp(lse) + exp(sink)), so

    out = flex_out * sigmoid(lse - sink_h)

Block masks are built once per (length, window, device) and cached; `prepare_masks` fills the cache
from eager code (a forward pre-hook set by `pithtrain.compile`) so compiled attention only reads it.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # torch < 2.9: the older keyword
    AuxRequest = None

_MASKS: dict = {}
_compiled_flex = None


def _mask_mod(window):
    if window is None:
        def causal(b, h, q, k):
            return k <= q
        return causal

    def sliding(b, h, q, k):  # keys within the last `window` positions, Hugging Face's convention
        return (k <= q) & (k > q - window)
    return sliding


def block_mask(S: int, window: int | None, device) -> object:
    key = (S, window, str(device))
    if key not in _MASKS:
        _MASKS[key] = create_block_mask(_mask_mod(window), B=None, H=None, Q_LEN=S, KV_LEN=S,
                                        device=device)
    return _MASKS[key]


def prepare_masks(S: int, windows, device):
    for w in set(windows):
        block_mask(S, w if w is not None and w < S else None, device)


def document_block_masks(docs_BS: torch.Tensor, windows) -> dict:
    """window -> BlockMask of causal (windowed) attention within each row's documents (document
    masking; docs_BS the document index per token). Built per batch, in eager code."""
    B, S = docs_BS.shape
    masks = {}
    for w in {w if w is not None and w < S else None for w in windows}:
        inner = _mask_mod(w)

        def same_doc(b, h, q, k, inner=inner):
            return inner(b, h, q, k) & (docs_BS[b, q] == docs_BS[b, k])
        masks[w] = create_block_mask(same_doc, B=B, H=None, Q_LEN=S, KV_LEN=S, device=docs_BS.device)
    return masks


def flex_sink_attention(q_BHSd, k_BKSd, v_BKSe, *, scale: float, window: int | None = None,
                        sinks_H: torch.Tensor | None = None, doc_mask=None):
    """doc_mask: a document mask (document_block_masks); None: the cached causal / window mask."""
    global _compiled_flex
    S = q_BHSd.shape[2]
    mask = doc_mask
    if mask is None:
        mask = block_mask(S, window if window is not None and window < S else None, q_BHSd.device)
    gqa = k_BKSd.shape[1] != q_BHSd.shape[1]
    fn = flex_attention
    if not torch.compiler.is_compiling():  # eager callers need the compiled kernel, not the reference
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    if sinks_H is None:
        return fn(q_BHSd, k_BKSd, v_BKSe, block_mask=mask, scale=scale, enable_gqa=gqa)
    if AuxRequest is not None:
        out, aux = fn(q_BHSd, k_BKSd, v_BKSe, block_mask=mask, scale=scale, enable_gqa=gqa,
                      return_aux=AuxRequest(lse=True))
        lse_BHS = aux.lse
    else:
        out, lse_BHS = fn(q_BHSd, k_BKSd, v_BKSe, block_mask=mask, scale=scale, enable_gqa=gqa,
                          return_lse=True)
    w_BHS = torch.sigmoid(lse_BHS.float() - sinks_H.float()[None, :, None])
    return out * w_BHS[..., None].to(out.dtype)
