"""Small building blocks shared by the model files: norm, RoPE, attention call, MLPs, grouped experts,
token permutation, the auxiliary-loss hook and the chunked loss (load balancing: balance.py). Each
is a plain function or module, called directly by the model files; nothing here knows about ranks
or process groups.

Shape legend (suffixes): B batch, S sequence, T tokens (B*S flattened), D model width, H heads,
K kv heads, E experts, F expert hidden width, A top-k slots, V vocabulary, X dispatched rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pithtrain import check
from pithtrain.models.balance import Balance
from pithtrain.models.init import init_by_block

# ---------------------------------------------------------------------------------------------
# The checks every family config's validate(err) shares


MAX_DIM = 1 << 24  # no size or count of a model this trains comes near it; bounds allocation
MAX_LAYERS = 10_000


def check_sizes(cfg, err, positive: str):
    """Types and ranges checked before anything is allocated (a hub config.json reaches the model
    without passing config._coerce): integers are integers within MAX_DIM, floats are finite, RoPE's
    base, the norm epsilon and the init std are > 0, each field named in `positive` (space-separated)
    is >= 1 and top_k is within num_experts; for GQA attention (a config with num_kv_heads), that it
    divides num_heads and that head_dim is even (RoPE)."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        v, tp = getattr(cfg, f.name), hints[f.name]
        if tp is int and (isinstance(v, bool) or not isinstance(v, int) or v > MAX_DIM):
            err(f.name, f"expected an integer <= {MAX_DIM}, got {v!r}")
        if tp is float and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            err(f.name, f"expected a finite number, got {v!r}")  # nan passes every `<` check
    if cfg.num_layers > MAX_LAYERS:
        err("num_layers", f"expected at most {MAX_LAYERS}, got {cfg.num_layers}")
    for k in ("rope_theta", "rms_norm_eps", "init_std"):
        if not getattr(cfg, k) > 0:
            err(k, f"must be > 0, got {getattr(cfg, k)}")
    check(cfg, err, positive, lambda v: v >= 1, ">= 1")
    if cfg.top_k > cfg.num_experts:
        err("top_k", f"{cfg.top_k} exceeds num_experts ({cfg.num_experts})")
    if hasattr(cfg, "num_kv_heads"):
        if cfg.num_heads % cfg.num_kv_heads:
            err("num_kv_heads", f"must divide num_heads ({cfg.num_heads}), got {cfg.num_kv_heads}")
        check(cfg, err, "head_dim", lambda v: v % 2 == 0, "even for RoPE")


# ---------------------------------------------------------------------------------------------
# Token embedding, norm and rotary embeddings


class Embedding(nn.Embedding):
    """nn.Embedding whose lookup, (ids, weight) -> rows, is the model's own swappable attribute:
    F.embedding, or kernels/wgrad.embedding (bound by use_kernels: the weight gradient accumulates
    in place over micro-batches, touching only the rows of the tokens seen). No padding_idx,
    max_norm or the other options: the lookup takes (ids, weight) only."""

    lookup = staticmethod(F.embedding)

    def forward(self, ids):
        return self.lookup(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        # Same op order as Hugging Face (normalise in fp32, cast back, then scale).
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(dim: int, theta: float, scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (dim/2,) and the attention-scale factor for cos/sin ("mscale").

    scaling: None (plain RoPE) or a Hugging Face `rope_scaling` dict of type "yarn".
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("yarn", "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: yarn)")
    if kind == "default":
        return inv_freq, 1.0
    factor = scaling["factor"]
    orig = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    else:
        attention_factor = scaling.get("attention_factor") or get_mscale(factor)

    def correction_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


class Rotary(nn.Module):
    """cos/sin tables computed from positions on each call (cheap; nothing position-sized is cached).
    It runs eagerly before the layers (the pipeline's stages too), so it also prepares what the
    attention kernels (set by use_kernels) read of a batch with documents: flash-attn-4's document
    starts (`fa4`: some layer runs it) and FlexAttention's block masks (`flex`), made unless every
    layer's attention is flash-attn-4 (`fa4_all`) and it takes the batch (half-precision autocast)."""

    def __init__(self, dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.dim, self.theta, self.scaling = dim, theta, scaling
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.mscale = 1.0
        self.flex = None  # the model's kernels.flex.FlexAttention, or None (reference attention)
        self.fa4 = self.fa4_all = False  # flash-attn-4 is some / every layer's attention (kernels/fa4.py)

    def reset_parameters(self):
        inv_freq, self.mscale = rope_inv_freq(self.dim, self.theta, self.scaling)
        with torch.no_grad():
            self.inv_freq.copy_(inv_freq.to(self.inv_freq.device))

    def forward(self, positions_BS: torch.Tensor, docs_BS: torch.Tensor | None = None) -> Rope:
        """docs_BS: the document index per token (document masking), or None."""
        docs = None
        if docs_BS is not None:
            fa4_only = self.fa4_all and autocast_dtype(docs_BS.device) in HALF
            masks = self.flex.document_masks(docs_BS) if self.flex is not None and not fa4_only else None
            docs = Documents(docs_BS, masks, document_starts(docs_BS) if self.fa4 else None)
        if self.flex is not None and docs is None:
            self.flex.prepare(positions_BS.shape[1], positions_BS.device)
        freqs = positions_BS[..., None].float() * self.inv_freq  # (B, S, dim/2)
        return Rope(freqs.cos() * self.mscale, freqs.sin() * self.mscale, docs)


class Documents(NamedTuple):
    """Document masking (data.document_mask): attention stays inside each token's document."""
    ids_BS: torch.Tensor  # document index of each token, non-decreasing along S
    block_masks: dict | None = None  # with FlexAttention: window -> BlockMask of ids_BS (kernels/flex.py)
    cu_seqlens: torch.Tensor | None = None  # with flash-attn-4: document_starts(ids_BS)


class Rope(NamedTuple):
    """What a layer's attention needs besides its input: the RoPE tables of the batch's positions
    and, with document masking, the documents. Passed unchanged through every layer."""
    cos_BSd2: torch.Tensor
    sin_BSd2: torch.Tensor
    docs: Documents | None = None


def document_firsts(docs_BS: torch.Tensor) -> torch.Tensor:
    """(B, S) bool: the token starts a document (each row's first token does)."""
    first_BS = torch.ones_like(docs_BS, dtype=torch.bool)
    first_BS[:, 1:] = docs_BS[:, 1:] != docs_BS[:, :-1]
    return first_BS


def document_positions(docs_BS: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 on each document's first token: (B, S) int64."""
    idx_BS = torch.arange(docs_BS.shape[1], device=docs_BS.device).expand_as(docs_BS)
    start_BS = torch.where(document_firsts(docs_BS), idx_BS, 0).cummax(dim=1).values
    return idx_BS - start_BS


def document_starts(docs_BS: torch.Tensor) -> torch.Tensor:
    """Where each document starts among the batch's B * S tokens taken row after row, then B * S:
    (N + 1,) int32, flash-attn-4's `cu_seqlens` (a row's first token starts a document). N depends
    on the data, so this waits for the GPU once per micro-batch (eager, in Rotary)."""
    starts = document_firsts(docs_BS).flatten().nonzero().flatten()
    return torch.cat([starts, starts.new_tensor([docs_BS.numel()])]).to(torch.int32)


HALF = (torch.bfloat16, torch.float16)  # flash-attn-4's dtypes


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes in on `device`, or None when it is off (always on meta, where
    shapes are traced: autocast has no meta device)."""
    dev = device.type
    return torch.get_autocast_dtype(dev) if dev != "meta" and torch.is_autocast_enabled(dev) else None


def apply_rope(x_BHSd, rope: Rope):
    """Rotate-half RoPE (Qwen3, GPT-OSS, and DeepSeek after its interleave permutation)."""
    dtype = x_BHSd.dtype
    x1, x2 = x_BHSd.float().chunk(2, dim=-1)
    cos, sin = rope.cos_BSd2[:, None], rope.sin_BSd2[:, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


# ---------------------------------------------------------------------------------------------
# Attention call: one place that chooses the kernel


def attention(q_BHSd, k_BKSd, v_BKSe, *, scale: float, window: int | None = None,
              sinks_H: torch.Tensor | None = None, docs: Documents | None = None,
              sdpa_first: list | None = None, flex=None, fa4: bool = False):
    """Causal attention with optional sliding window (keys within the last `window` positions,
    Hugging Face's convention), learned sinks (an extra logit per head that takes softmax mass) and
    document masking (keys of the query's own document only).
    GQA: K may divide H. With `fa4`, half-precision attention runs on flash-attn-4 (kernels/fa4.py;
    documents through its varlen interface, `docs.cu_seqlens`). Otherwise the plain case uses SDPA,
    trying the backends `sdpa_first` first (cuDNN's fused kernel takes GQA as is, and d_qk != d_v
    as in DeepSeek's MLA, where SDPA's own order falls back to the slower memory-efficient
    kernel), else in SDPA's own order.
    Windows / sinks / documents go to `flex` (a kernels.flex.FlexAttention; document masks come
    built in `docs.block_masks`), else to the eager reference. use_kernels binds `sdpa_first`,
    `flex` and `fa4` per model (each attention module's `attention` is this function, bound)."""
    if fa4 and (docs is None or docs.cu_seqlens is not None):
        half = autocast_dtype(q_BHSd.device) or q_BHSd.dtype
        if half in HALF:  # its kernels' dtypes; float32 runs take SDPA / FlexAttention
            from pithtrain.kernels.fa4 import attention as fa4_attention
            q, k, v = (t.transpose(1, 2).to(half) for t in (q_BHSd, k_BKSd, v_BKSe))  # as SDPA's autocast rule
            return fa4_attention(q, k, v, scale=scale, window=window, sinks_H=sinks_H,
                                 cu_seqlens=None if docs is None else docs.cu_seqlens).transpose(1, 2)
    if docs is not None:
        if docs.block_masks is not None:  # made by the model's rotary with its `flex`
            S = q_BHSd.shape[2]
            mask = docs.block_masks[window if window is not None and window < S else None]
            return flex(q_BHSd, k_BKSd, v_BKSe, scale=scale, window=window, sinks_H=sinks_H, doc_mask=mask)
        return eager_attention(q_BHSd, k_BKSd, v_BKSe, scale=scale, window=window, sinks_H=sinks_H,
                               docs_BS=docs.ids_BS)
    if window is None and sinks_H is None:
        gqa = k_BKSd.shape[1] != q_BHSd.shape[1]
        with torch.nn.attention.sdpa_kernel(sdpa_first, set_priority=True) if sdpa_first else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q_BHSd, k_BKSd, v_BKSe, is_causal=True, scale=scale,
                                                  enable_gqa=gqa)
    if flex is not None:
        return flex(q_BHSd, k_BKSd, v_BKSe, scale=scale, window=window, sinks_H=sinks_H)
    return eager_attention(q_BHSd, k_BKSd, v_BKSe, scale=scale, window=window, sinks_H=sinks_H)


# The math kernel last: float32 GQA (parity tests, fp32 validation runs) has no fused kernel.
SDPA_CUDNN_FIRST = [torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
                    torch.nn.attention.SDPBackend.FLASH_ATTENTION,
                    torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
                    torch.nn.attention.SDPBackend.MATH]


def eager_attention(q_BHSd, k_BKSd, v_BKSe, *, scale, window=None, sinks_H=None, q_offset=0,
                    docs_BS=None):
    """Reference attention with the score matrix materialised (CPU, tests, and small shapes).
    q_offset: absolute position of the first query relative to the first key (context parallel).
    docs_BS: document index per token (queries and keys alike); keys of other documents are masked."""
    H, K = q_BHSd.shape[1], k_BKSd.shape[1]
    if K != H:
        k_BKSd = k_BKSd.repeat_interleave(H // K, dim=1)
        v_BKSe = v_BKSe.repeat_interleave(H // K, dim=1)
    s_BHSS = torch.matmul(q_BHSd, k_BKSd.transpose(-1, -2)) * scale
    Sq, Sk = q_BHSd.shape[2], k_BKSd.shape[2]
    qi = torch.arange(Sq, device=q_BHSd.device)[:, None] + q_offset
    kj = torch.arange(Sk, device=q_BHSd.device)[None, :]
    allowed = kj <= qi
    if window is not None:
        allowed &= kj > qi - window
    if docs_BS is not None:  # (B, 1, S, S): same document
        allowed = allowed & (docs_BS[:, None, :, None] == docs_BS[:, None, None, :])
    s_BHSS = s_BHSS.masked_fill(~allowed, float("-inf"))
    if sinks_H is not None:
        sink = sinks_H.reshape(1, -1, 1, 1).expand(s_BHSS.shape[0], -1, Sq, 1).to(s_BHSS.dtype)
        s_BHSS = torch.cat([s_BHSS, sink], dim=-1)
        s_BHSS = s_BHSS - s_BHSS.amax(dim=-1, keepdim=True).detach()
    p = F.softmax(s_BHSS.float(), dim=-1).to(q_BHSd.dtype)[..., :Sk]  # a sink's column takes mass, no value
    return torch.matmul(p, v_BKSe)


# ---------------------------------------------------------------------------------------------
# MLPs and grouped experts


class SwiGLUMLP(nn.Module):
    """Dense SwiGLU MLP (dense layers, DeepSeek shared experts), Hugging Face names."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def swiglu(h_XF2, alpha: float | None = None, limit: float | None = None):
    """silu(gate) * up on the concatenated [gate | up] rows. With alpha/limit: GPT-OSS's clamped
    variant, gate.clamp(max=limit) * sigmoid(alpha * gate) * (up.clamp(-limit, limit) + 1).
    Fused: kernels/swiglu.py (GroupedExperts.swiglu, set by use_kernels)."""
    gate, up = h_XF2.chunk(2, dim=-1)
    if alpha is None:
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


def grouped_mm(x_XD, w_EDF, offs_E):
    """rows of x (expert-contiguous, offs = cumulative end row per expert) @ w[e], in x's dtype
    (w: the parameter; expert parallel's DTensor gives its local block). torch's grouped matmul
    where its dtype, device and alignment rules allow it; the per-expert loop otherwise."""
    w_EDF = local(w_EDF).to(x_XD.dtype)
    ok = (x_XD.dtype in (torch.float32, torch.bfloat16)
          and (x_XD.is_cuda or x_XD.dtype == torch.float32)
          and all((n * x_XD.element_size()) % 16 == 0 for n in w_EDF.shape[1:]))
    if ok:
        return F.grouped_mm(x_XD, w_EDF, offs=offs_E.to(torch.int32))
    return grouped_mm_loop(x_XD, w_EDF, offs_E)


def grouped_mm_loop(x_XD, w_EDF, offs_E):
    """Reference: one matmul per expert over its contiguous rows."""
    w_EDF = local(w_EDF).to(x_XD.dtype)
    out = x_XD.new_empty(x_XD.shape[0], w_EDF.shape[-1])
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        out[start:end] = x_XD[start:end] @ w_EDF[e]
        start = end
    return out


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: w13 (E, D, 2F) = [gate | up], w2 (E, F, D).
    Optional biases (GPT-OSS) and the clamped activation (alpha/limit). The operators are
    attributes, references until use_kernels binds the fused ones: `mm` the grouped GEMM
    (x_XD, w parameter, offs_E) -> y, `swiglu`, `bias_add` (h, b_EN, expert_X, offs_E) -> h + b."""

    def __init__(self, num_experts: int, dim: int, hidden: int, bias: bool = False,
                 alpha: float | None = None, limit: float | None = None):
        super().__init__()
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        # The witness that dropped slots are not computed: rows the training forwards gave the GEMMs
        # since the last optimizer step (recomputation not counted); balance_after_step reads and resets it.
        self.rows_computed = 0
        self.alpha, self.limit = alpha, limit
        self.w13_EDF2 = nn.Parameter(torch.empty(num_experts, dim, 2 * hidden))
        self.w2_EFD = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.b13_EF2 = nn.Parameter(torch.empty(num_experts, 2 * hidden)) if bias else None
        self.b2_ED = nn.Parameter(torch.empty(num_experts, dim)) if bias else None
        self.mm, self.swiglu, self.bias_add = grouped_mm, swiglu, add_expert_bias

    def forward(self, x_XD, counts_E):
        """x: rows sorted by expert, counts_E[e] rows for expert e (experts local to this rank).
        Under autocast the experts compute in its dtype like every nn.Linear: the residual stream
        (and so x) stays float32 with float32 master weights, and autocast has no rule for the
        grouped GEMM, so x and the weights are cast here; the output is in that dtype too."""
        dev = x_XD.device.type
        if self.training and torch._C._current_graph_task_id() == -1:  # as route_tokens counts
            self.rows_computed += x_XD.shape[0]
        if torch.is_autocast_enabled(dev):
            x_XD = x_XD.to(torch.get_autocast_dtype(dev))
        offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)  # the grouped GEMMs' type, made once
        h_XF2 = self.mm(x_XD, self.w13_EDF2, offs_E)
        if self.b13_EF2 is not None:
            expert_X = torch.repeat_interleave(torch.arange(len(counts_E), device=x_XD.device),
                                               counts_E, output_size=x_XD.shape[0])
            h_XF2 = self.bias_add(h_XF2, local(self.b13_EF2).to(x_XD.dtype), expert_X, offs_E)
        y_XD = self.down(h_XF2, offs_E)
        if self.b2_ED is not None:
            y_XD = self.bias_add(y_XD, local(self.b2_ED).to(x_XD.dtype), expert_X, offs_E)
        return y_XD

    def down(self, h_XF2, offs_E):
        """The activation and the second GEMM. Its own method so that activation checkpointing's
        "cheap" policy (pithtrain/compile.py) can recompute the activation from h in backward
        instead of keeping it: the GEMM saves its input before it runs, where the recompute stops."""
        return self.mm(self.swiglu(h_XF2, self.alpha, self.limit), self.w2_EFD, offs_E)


def expert_counts(idx_X, num_experts):
    """Routed slots per expert, on the device without a host synchronisation: torch.bincount on
    CUDA reads the indices' min and max to the host, which drained the GPU's queue twice in each
    MoE layer's forward (docs/perf-notes.md, 12-layer profile). scatter_add_, not index_add_: in
    the compiled dispatch plan inductor makes int64 index_add_ a sorting index_put_."""
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=idx_X.device)
    return counts_E.scatter_add_(0, idx_X, torch.ones_like(idx_X, dtype=torch.int64))


def expert_order(idx_X, num_experts):
    """Slots in expert order (a stable argsort of the expert ids). Up to 256 experts the keys are
    one byte: the GPU's radix sort then makes one pass over them instead of eight for int64."""
    return torch.argsort(idx_X.to(torch.uint8) if num_experts <= 256 else idx_X, stable=True)


def dispatch_plan(idx_TA, num_experts: int, inverse: bool, drops: bool = False):
    """The routed slots' expert order, the slots per expert and, for the fused permute, where each
    slot landed in that order (once per layer: combine takes it too). Integer work without
    gradients, a handful of small operations: one graph under apply_compile. `drops`: slots the
    experts do not compute (computed_slots) sort last, in a bucket of their own; their inv_TA is -1."""
    flat_X = idx_TA.reshape(-1)
    if drops:
        flat_X = torch.where(computed_slots(flat_X, num_experts), flat_X, num_experts)
    order_X = expert_order(flat_X, num_experts + drops)
    inv_TA = None
    if inverse:  # inv_TA[t, a]: where slot t*A + a landed in expert order
        inv_X = torch.empty_like(order_X)
        inv_X[order_X] = torch.arange(order_X.numel(), device=order_X.device, dtype=order_X.dtype)
        inv_TA = inv_X.view(idx_TA.shape)
        if drops:
            inv_TA = torch.where(flat_X.view(idx_TA.shape) < num_experts, inv_TA, -1)
    return order_X, expert_counts(flat_X, num_experts + drops)[:num_experts], inv_TA


def add_expert_bias(h_XN, b_EN, expert_X, offs_E):
    """h + b[expert of row]. Fused: a Triton add and a segment-sum backward instead of index
    backward's sort + accumulate (kernels/expert_bias.py)."""
    return h_XN + b_EN[expert_X]


def local(w):
    """Expert parallel makes the stacked weights DTensors split by expert (distributed/
    parallelize.py); the rows a rank receives are for its own experts, so it computes on its block."""
    return w.to_local() if hasattr(w, "to_local") else w


def placed_like(t: torch.Tensor, local_value: torch.Tensor) -> torch.Tensor:
    """local_value as t is: a DTensor with t's mesh, placements and global shape when t is one (this
    rank's block of it), else local_value itself."""
    if hasattr(t, "to_local"):
        return type(t).from_local(local_value, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    return local_value


# ---------------------------------------------------------------------------------------------
# Token permutation (single device). Expert parallel replaces this unit: see distributed/.


class LocalDispatcher:
    """Permute tokens to expert-contiguous rows (dispatch) and scatter-add the expert outputs back
    weighted (combine). The expert-parallel dispatcher has the same methods and replaces this one.
    `dispatch` -> (x_XD rows for the experts, w: the routing weights in the form combine takes
    (differentiable), counts_E, info: what else combine needs, non-differentiable).
    `fused` (use_kernels; CUDA): the same maps as Triton gathers only (kernels/permute.py).
    `drops`: the router may return slots the experts do not compute (the contract above
    route_tokens); only the others are dispatched, their number read to the host once per call.
    Without it there is no host synchronisation, and such an id fails the per-expert count."""

    def __init__(self, drops: bool = False):
        self.fused, self.drops = False, drops
        self.plan = dispatch_plan  # compiled by apply_compile

    def dispatch(self, x_TD, idx_TA, w_TA, num_experts):
        order_X, counts_E, inv_TA = self.plan(idx_TA, num_experts, self.fused, self.drops)
        if self.drops:  # the computed slots come first in expert order
            order_X = order_X[:int(counts_E.sum())]
        if self.fused:
            from pithtrain.kernels.permute import permute
            x_XD = permute(x_TD, order_X, inv_TA)
        else:
            x_XD = x_TD[order_X // idx_TA.shape[1]]
        return x_XD, w_TA, counts_E, (order_X, x_TD.shape[0], inv_TA)

    def combine(self, y_XD, w_TA, info):
        order_X, T, inv_TA = info
        if self.fused:
            from pithtrain.kernels.permute import unpermute
            return unpermute(y_XD, w_TA.to(y_XD.dtype), order_X, inv_TA)
        w_X = w_TA.reshape(-1)[order_X].to(y_XD.dtype)
        out_TD = y_XD.new_zeros(T, y_XD.shape[-1])
        return out_TD.index_add(0, order_X // w_TA.shape[1], y_XD * w_X[:, None])


# ---------------------------------------------------------------------------------------------
# Auxiliary losses (load balancing, z-loss): attached to the activations, not returned through every layer


class AuxLoss(torch.autograd.Function):
    """Identity on x; in backward, adds d(scale * aux)/d(router) as if `scale * aux` were part of
    the loss. `aux` carries the coefficient; `scale` is the trainer's loss scale (1 / micro-batches
    of the global batch), the MoE block's `balance.loss_scale` (set_aux_loss_scale); this keeps
    pipeline stages free of extra outputs."""

    @staticmethod
    def forward(ctx, x, aux, scale: float):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def set_aux_loss_scale(model: nn.Module, scale: float):
    """The trainer's loss scale for the balancing losses of every MoE block of `model`."""
    for m in model.modules():
        if isinstance(m, Balance):
            m.loss_scale = scale


# ---------------------------------------------------------------------------------------------
# What every family's MoE block, layer and model do the same way (each family file passes its own
# attention, router and MLP; the names are Hugging Face's, so checkpoints map one to one)


# The router contract. `moe.route(x_TD)` returns (logits_TE, probs_TE, w_TA, idx_TA): float32
# logits and probabilities over the E ids the router scores (its width, `moe.balance.num_experts`),
# and per token A slots (top_k), each a weight (x's dtype, finite) and an id in [0, E) or DROPPED.
# The FFN experts (`moe.experts`) compute a slot only when its id is one of theirs, [0,
# experts.num_experts) (computed_slots): a DROPPED slot, or an id past the FFN experts (a router
# wider than them, e.g. zero-compute experts), is not dispatched, not sent by the all-to-all and not
# computed, and its weight is not used; a block whose router returns such slots builds
# LocalDispatcher(drops=True). Balancing counts every id >= 0 (models/balance.py). Weight 0 on an
# expert's id still computes the slot; it only adds nothing.
DROPPED = -1


def computed_slots(idx, num_experts: int):
    """Bool, idx's shape: the slots the `num_experts` FFN experts compute (the contract above)."""
    return (idx >= 0) & (idx < num_experts)


def route_tokens(moe, x_TD, sequences: int | None = None):
    """`moe.route(x)` -> (router logits, router probabilities over all experts, top-k weights,
    top-k ids), plus what every MoE does around it through its balancing unit `moe.balance`
    (models/balance.py): count the routing for the step's load (training only), and when
    training with gradients make the coefficient-weighted balancing loss (else None) for
    `AuxLoss` to attach. `sequences`: how many sequences the T rows hold (the sequence-level
    loss needs it). Inside a backward pass (graph task id != -1) a forward is activation
    checkpointing's recompute of a micro-batch already counted (torch.utils.checkpoint tells the
    two apart the same way), so it is not counted again."""
    if not moe.training:
        _, _, w_TA, idx_TA = moe.route(x_TD)
        return w_TA, idx_TA, None
    count = torch._C._current_graph_task_id() == -1
    routing = getattr(moe, "routing", route_and_observe)  # apply_compile's compiled one, where set
    return routing(moe, x_TD, sequences, count, torch.is_grad_enabled())


def route_and_observe(moe, x_TD, sequences: int | None, count: bool, loss: bool):
    """The router, then its balancing unit's `observe` (count and loss): one graph under
    apply_compile, so the router's softmax and the balancing statistics fuse, and the host pays
    one compiled call per MoE layer, forward and backward, instead of two."""
    logits_TE, probs_TE, w_TA, idx_TA = moe.route(x_TD)
    return w_TA, idx_TA, moe.balance.observe(logits_TE, probs_TE, idx_TA, sequences, count, loss)


@dataclass
class Phase:
    """One step of a layer's forward over named values: `fn(**{name: value for name in inputs})`
    returns a dict of new values. `comm`: the step is communication (expert parallel's all-to-all;
    the pipeline runs it on the communication stream, under another micro-batch's compute).
    `params()`: the parameters whose gradients the step makes, read when asked (FSDP swaps a
    layer's parameters between sharded and gathered tensors). `unit`: the layer it belongs to."""
    name: str
    comm: bool
    fn: Callable
    inputs: tuple
    params: Callable[[], list]
    unit: nn.Module | None = None


class DecoderLayer(nn.Module):
    """Pre-norm residual layer: h + attn(norm(h)), then that + mlp(norm(that)). `forward` runs
    `phases`, the one description of the layer's computation, in order."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, dim: int, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)

    def attend(self, h_BSD, rope):
        """The attention phase: h1 = h + attention(norm(h)), and the MLP's input norm(h1). One
        graph under apply_compile (the residual add and both norms fused around the attention)."""
        h1 = h_BSD + self.self_attn(self.input_layernorm(h_BSD), rope)
        return h1, self.post_attention_layernorm(h1)

    def forward(self, x_BSD, rope):
        return run_phases(self.phases(rope), {"h": x_BSD})["out"]

    def phases(self, rope) -> list[Phase]:
        """The layer as phases from "h" (B, S, D) to "out": its attention, then its MLP block's
        phases (mlp_phases). The pipeline runs the same list (distributed/overlap.py).

            attn      h -> h1 = h + attention(norm(h)), x = norm(h1)
        """
        attn = self.self_attn

        def attention(h):
            h1, x = self.attend(h, rope)
            return {"h1": h1, "x": x}

        def attn_params():
            return [*attn.parameters(), *self.input_layernorm.parameters(),
                    *self.post_attention_layernorm.parameters()]

        return [Phase("attn", False, attention, ("h",), attn_params, self), *mlp_phases(self.mlp, self)]


def run_phases(phases: list[Phase], state: dict) -> dict:
    """Run `phases` in order over `state` (name -> value): each reads its inputs and adds its
    outputs. DecoderLayer.forward is this over its phases."""
    for ph in phases:
        state.update(ph.fn(**{n: state[n] for n in ph.inputs}))
    return state


def mlp_phases(mlp: nn.Module, unit: nn.Module | None = None) -> list[Phase]:
    """A layer's MLP block as phases from "h1" (the residual) and "x" (its normalised input,
    (B, S, D)) to "out". A dense block (no `dispatcher`) is one phase, `h1 + mlp(x)`. A MoE
    block of any family has no forward of its own: these phases are its computation, calling
    what every family's block keeps (`route` through route_tokens, `dispatcher.dispatch /
    combine`, `experts`, optional `shared_experts`), so a variant's code goes in those.

        route     x -> top-k weights w, ids idx, load-balancing loss aux (or None)
        dispatch  comm: x, idx, w -> expert rows xd, weights wd, counts, info
        experts   xd -> yd (grouped experts); x -> ys (shared experts, if any)
        combine   comm: yd, wd -> y (T, D)
        residual  out = h1 + (y with aux's gradient attached) (+ ys)
    """
    if not hasattr(mlp, "dispatcher"):
        return [Phase("mlp", False, lambda h1, x: {"out": h1 + mlp(x)}, ("h1", "x"),
                      lambda: list(mlp.parameters()), unit)]
    shared = getattr(mlp, "shared_experts", None)

    def route(x):
        w_TA, idx_TA, aux = route_tokens(mlp, x.flatten(0, 1), sequences=x.shape[0])
        return {"w": w_TA, "idx": idx_TA, "aux": aux}

    def dispatch(x, idx, w):
        x_XD, w_d, counts_E, info = mlp.dispatcher.dispatch(x.flatten(0, 1), idx, w,
                                                            mlp.experts.num_experts)  # not the router's width
        return {"xd": x_XD, "wd": w_d, "counts": counts_E, "info": info}

    def experts(xd, counts, x):
        out = {"yd": mlp.experts(xd, counts)}
        if shared is not None:
            out["ys"] = shared(x.flatten(0, 1))
        return out

    def combine(yd, wd, info):
        return {"y": mlp.dispatcher.combine(yd, wd, info)}

    def residual(h1, y, aux, ys=None):
        y_TD = y if aux is None else AuxLoss.apply(y, aux, mlp.balance.loss_scale)
        if ys is not None:
            y_TD = y_TD + ys
        return {"out": h1 + y_TD.view(h1.shape)}

    def router_params():
        return [p for n, p in mlp.named_parameters() if not n.startswith(("experts.", "shared_experts."))]

    def expert_params():
        return [*mlp.experts.parameters(), *(shared.parameters() if shared is not None else ())]

    none = list
    return [Phase("route", False, route, ("x",), router_params, unit),
            Phase("dispatch", True, dispatch, ("x", "idx", "w"), none, unit),
            Phase("experts", False, experts, ("xd", "counts", "x"), expert_params, unit),
            Phase("combine", True, combine, ("yd", "wd", "info"), none, unit),
            Phase("residual", False, residual, ("h1", "y", "aux") + (("ys",) if shared is not None else ()),
                  none, unit)]


def mlp_output(mlp: nn.Module, x_BSD):
    """An MLP block's output on x (B, S, D) alone, computed by its phases (mlp_phases: the code a
    layer runs in training) with a zero residual: tests and a variant's checks call a block this
    way, since a MoE block has no forward of its own."""
    return run_phases(mlp_phases(mlp), {"h1": torch.zeros_like(x_BSD), "x": x_BSD})["out"]


def use_kernels(model: nn.Module, use: dict, copies=None) -> nn.Module:
    """Resolve a run's kernel choice (kernels.configure: name -> on) into `model`'s own swappable
    attributes, in place: the fused operator where `use` says so, the reference elsewhere. Before
    parallelize (context parallel then replaces the attention call) and before compile. `copies`:
    the run's bf16 weight copies (precision.WeightCopies, or None), whose masters the in-place
    weight gradients write (kernels/wgrad.py). flash-attn-4 is bound per layer, only where its
    tested shapes cover the layer's attention (kernels/fa4.py `covers`); the rotary makes the
    document masks whenever some layer's attention will not be flash-attn-4."""
    from pithtrain.kernels.fa4 import covers
    flex = None
    if use["flex"]:
        from pithtrain.kernels.flex import FlexAttention
        flex = FlexAttention(model.cfg.attention_shapes(i)[0] for i in range(model.cfg.num_layers))
    bound = {on: functools.partial(attention, sdpa_first=SDPA_CUDNN_FIRST if use["cudnn_sdpa"] else None, flex=flex,
                                   fa4=on) for on in (False, True)}
    on_fa4 = []  # per layer: every attention call of it is flash-attn-4
    for i, layer in indexed_layers(model):
        fa4 = use["fa4"] and covers(model.cfg.attention_shapes(i))
        calls = [m for m in layer.modules() if callable(getattr(m, "attention", None))]
        for m in calls:
            if attention in (m.attention, getattr(m.attention, "func", None)):  # not context parallel's
                m.attention = bound[fa4]
        on_fa4.append(bool(calls) and all(m.attention is bound[True] for m in calls))
    model.rotary.flex, model.rotary.fa4, model.rotary.fa4_all = flex, any(on_fa4), all(on_fa4)
    model.cross_entropy = functools.partial(cross_entropy_sum, fused=use["linear_ce"], in_place=use["wgrad_ends"],
                                            copies=copies)
    for m in model.modules():
        if isinstance(m, Embedding):
            from pithtrain.kernels import wgrad
            m.lookup = functools.partial(wgrad.embedding, copies=copies) if use["wgrad_ends"] else F.embedding
        if isinstance(getattr(m, "dispatcher", None), LocalDispatcher):
            m.dispatcher.fused = use["permute"]
        if isinstance(m, GroupedExperts):
            m.mm = grouped_mm
            if use["fp8"] and use["deepgemm"]:  # each its own FP8 weight cache
                from pithtrain.kernels import deepgemm
                m.mm = deepgemm.FP8GroupedMM(deepgemm.load(), in_place=use["wgrad"], copies=copies)
            elif use["fp8"]:
                from pithtrain.kernels.fp8_linear import FP8GroupedMM
                m.mm = FP8GroupedMM()
            elif use["wgrad"]:
                from pithtrain.kernels.wgrad import grouped_mm as in_place_mm
                m.mm = functools.partial(in_place_mm, reference=grouped_mm, copies=copies)
            m.swiglu, m.bias_add = swiglu, add_expert_bias
            if use["swiglu"]:
                from pithtrain.kernels.swiglu import swiglu as fused_swiglu
                m.swiglu = fused_swiglu
            if use["expert_bias"]:
                from pithtrain.kernels.expert_bias import expert_bias_add
                m.bias_add = expert_bias_add
    return model


def attention_kernels(model: nn.Module, use: dict) -> dict[int, str]:
    """Each decoder layer's attention kernel, read from the calls use_kernels (or context parallel)
    bound into it: the witness kernels.describe prints at start-up. A variant's own call is named
    by its qualified name; a layer the run allowed flash-attn-4 (`use`) that does not run it says
    its shape is not one flash-attn-4 is tested at."""
    from pithtrain.kernels.fa4 import covers
    out = {}
    for i, layer in indexed_layers(model):
        names = set()
        for call in (getattr(m, "attention", None) for m in layer.modules()):
            if not callable(call):
                continue
            kw = call.keywords if getattr(call, "func", None) is attention else {} if call is attention else None
            if kw is None:
                names.add(getattr(call, "__qualname__", type(call).__qualname__))
            elif kw.get("fa4"):
                names.add("flash-attn-4")
            else:  # plain causal attention on SDPA; windows, sinks and documents on FlexAttention or eager
                flex = "FlexAttention" if kw.get("flex") else "eager"
                names.add(f"{'cuDNN ' if kw.get('sdpa_first') else ''}SDPA/{flex}")
        out[i] = "+".join(sorted(names)) or "none"
        shape = model.cfg.attention_shapes(i)
        if use["fa4"] and "flash-attn-4" not in names and not covers(shape):
            out[i] += f" (d_qk {shape[1]}, d_v {shape[2]}: not a shape flash-attn-4 is tested at, kernels/fa4.py)"
    return out


def indexed_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, layer) of the model's decoder layers in order: `model.layers` is a ModuleList,
    or on a pipeline stage a ModuleDict keyed by layer index holding only this stage's layers."""
    layers = model.layers
    return [(int(i), m) for i, m in layers.items()] if isinstance(layers, nn.ModuleDict) else list(enumerate(layers))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers in order (indexed_layers without the indices)."""
    return [m for _, m in indexed_layers(model)]


class CausalLM(nn.Module):
    """The frame every family's model is: embedding, RoPE, its decoder layers (one per (attention,
    MLP) pair in `blocks`), final norm, LM head. forward(input_ids) -> logits (B, S, V);
    forward(input_ids, labels=...) -> summed token loss. `init_block` gives one block its values
    (Hugging Face's scheme, init_normal; a family adds its extras by overriding it)."""

    def __init__(self, cfg, rotary: nn.Module, blocks):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = rotary
        self.layers = nn.ModuleList(DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps) for attn, mlp in blocks)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.cross_entropy = cross_entropy_sum  # the head's loss; use_kernels may bind the fused one
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_weights(self):
        init_by_block(self, self.init_block)

    def init_block(self, block):
        init_normal(block, self.cfg.init_std)

    def forward(self, input_ids_BS, positions_BS=None, labels_BS=None, docs_BS=None):
        """embed -> layers -> norm -> logits (B, S, V), or the summed token loss when labels are given
        (chunked, so full-vocabulary logits never exist at once). Positions default to 0..S-1, or with
        docs_BS (document index per token: document masking) to 0.. from each document's start."""
        if docs_BS is not None and positions_BS is None:
            positions_BS = document_positions(docs_BS)
        if positions_BS is None:
            positions_BS = torch.arange(input_ids_BS.shape[1], device=input_ids_BS.device).expand_as(input_ids_BS)
        rope = self.rotary(positions_BS, docs_BS)
        h_BSD = self.embed_tokens(input_ids_BS)
        for layer in self.layers:
            h_BSD = layer(h_BSD, rope)
        if labels_BS is None:
            return self.lm_head(self.norm(h_BSD))
        return head_loss(self, h_BSD, labels_BS)


def head_loss(model, h_BSD, labels_BS):
    """Final norm, LM head and the summed token loss (the pipeline's last stage calls this too)."""
    return model.cross_entropy(model.norm(h_BSD).flatten(0, 1), model.lm_head.weight, labels_BS.flatten())


# ---------------------------------------------------------------------------------------------
# Loss


def cross_entropy_sum(h_TD, weight_VD, labels_T, chunk: int = 4096, fused: bool = False, in_place: bool = False,
                      copies=None):
    """Sum of token cross-entropies (labels == -100 ignored), with logits made `chunk` rows at a
    time under activation checkpointing, so (T, V) logits never exist at once in fp32.
    `fused` (use_kernels binds it into the model's `cross_entropy`) and gradients wanted: each
    chunk once, its gradients made in the forward pass (kernels/linear_ce.py), saving the
    recomputed LM-head matmul; `in_place` there: the head's weight gradient accumulates in place
    over micro-batches (kernels/wgrad.py; into the master of a bf16 copy in `copies`)."""
    wants_grad = torch.is_grad_enabled() and (h_TD.requires_grad or weight_VD.requires_grad)
    if fused and wants_grad:
        from pithtrain.kernels.linear_ce import linear_cross_entropy_sum
        return linear_cross_entropy_sum(h_TD, weight_VD, labels_T, chunk, in_place, copies)
    total = h_TD.new_zeros((), dtype=torch.float32)
    for s in range(0, h_TD.shape[0], chunk):
        total = total + torch.utils.checkpoint.checkpoint(
            _ce_chunk, h_TD[s:s + chunk], weight_VD, labels_T[s:s + chunk], use_reentrant=False)
    return total


def _ce_chunk(h, w, labels):
    logits = (h @ w.to(h.dtype).t()).float()
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


# ---------------------------------------------------------------------------------------------
# Initialisation (block by block, each block from its own seed: models/init.py)


@torch.no_grad()
def init_normal(model: nn.Module, std: float):
    """The initialisation the three families publish (Hugging Face's `_init_weights`): normal(0,
    std) for linear weights, embeddings and stacked experts, zero biases, ones for norms, RoPE
    tables recomputed. A family's `init_block` adds its own extras after this."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
        elif isinstance(m, (RMSNorm, Rotary, Balance)):
            m.reset_parameters()
        elif isinstance(m, GroupedExperts):
            nn.init.normal_(m.w13_EDF2, std=std)
            nn.init.normal_(m.w2_EFD, std=std)
            for b in (m.b13_EF2, m.b2_ED):
                if b is not None:
                    nn.init.zeros_(b)
