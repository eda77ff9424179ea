"""DeepSeek-V2 / V2-Lite: Multi-head Latent Attention, first-k dense layers, shared + routed experts.

Reads top to bottom: config, attention (MLA), MoE block, model (each layer a common.DecoderLayer
over these blocks), hub mapping. Matches Hugging Face's `DeepseekV2ForCausalLM` (transformers 5.x;
tests/test_deepseek_v2.py).

MLA in one picture (per token, per layer):
    q  = q_proj(x)                       or  q_b_proj(rmsnorm(q_a_proj(x)))      (V2: q_lora_rank set)
    c, k_pe = kv_a_proj_with_mqa(x)      c: the compressed latent (C), k_pe: one rope key shared by heads
    k_nope, v = kv_b_proj(rmsnorm(c))    per head
    score = [q_nope | rope(q_pe)] . [k_nope | rope(k_pe)] * scale
The scale is (N + R)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's correction
for the sharpened softmax; HF's `yarn_apply_mscale`).

Shape legend: see models/common.py, plus Q q-lora rank, C kv-lora rank (latent), N no-rope head dim,
R rope head dim, d = N + R query/key head dim, e value head dim, G expert groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from pithtrain import check
from pithtrain.models.balance import Balance, BalanceConfig
from pithtrain.models.common import (CausalLM, GroupedExperts, LocalDispatcher, RMSNorm, Rotary, SwiGLUMLP,
                                     apply_rope, attention, check_sizes)
from pithtrain.models.hub import field_names, fields_from_hf, fields_to_hf, per_expert_to_stacked, stacked_to_per_expert

# ---------------------------------------------------------------------------------------------
# Config

# (field, config.json key[, default when the hub omits it]) beyond hub.COMMON_KEYS; from_hf and
# to_hf map the rest themselves.
HF_KEYS = (("q_lora_rank", "q_lora_rank", None), ("kv_lora_rank", "kv_lora_rank"),
           ("qk_nope_head_dim", "qk_nope_head_dim"), ("qk_rope_head_dim", "qk_rope_head_dim"),
           ("v_head_dim", "v_head_dim"), ("first_k_dense_replace", "first_k_dense_replace", 0),
           ("intermediate_size", "intermediate_size"), ("moe_intermediate_size", "moe_intermediate_size"),
           ("top_k", "num_experts_per_tok"), ("routed_scaling_factor", "routed_scaling_factor", 1.0),
           ("attention_bias", "attention_bias", False), ("aux_loss_coeff", "aux_loss_alpha", 0.001))


@dataclass
class DeepseekV2Config(BalanceConfig):  # + balance, aux_loss_coeff, bias_update_rate, z_loss_coeff
    family: ClassVar[str] = "deepseek_v2"
    hf_architecture: ClassVar[str] = "DeepseekV2ForCausalLM"
    expert_width_field: ClassVar[str] = "moe_intermediate_size"  # one routed expert's hidden width F (w13 is D x 2F)
    # DeepSeek's cards count "activated" without the embedding lookup (V2-Lite 2.45B, published
    # as 2.4B; V2 20.9B -> 21B; V3 36.6B -> 37B); pithtrain.metrics.param_counts honours this.
    active_counts_embedding: ClassVar[bool] = False

    vocab_size: int = 264
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    q_lora_rank: int | None = None  # None: V2-Lite's plain q_proj; set: V2's low-rank query
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    first_k_dense_replace: int = 1  # layers [0, k) are dense SwiGLU, the rest MoE
    intermediate_size: int = 384  # dense layers
    moe_intermediate_size: int = 64  # one routed expert; the shared block is n_shared_experts wide
    num_experts: int = 8
    n_shared_experts: int = 2
    top_k: int = 2
    topk_method: Literal["greedy", "group_limited_greedy"] = "greedy"
    n_group: int = 1  # group_limited_greedy: experts split in n_group groups, top topk_group kept
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # a Hugging Face yarn dict (factor, mscale, mscale_all_dim, ...)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q_a_proj, kv_a_proj_with_mqa, o_proj (as HF)
    init_std: float = 0.02

    def validate(self, err):
        check_sizes(self, err, "vocab_size hidden_size num_layers num_heads kv_lora_rank qk_nope_head_dim "
                    "qk_rope_head_dim v_head_dim intermediate_size moe_intermediate_size num_experts top_k n_group "
                    "topk_group max_position_embeddings")
        check(self, err, "q_lora_rank", lambda v: v >= 1, ">= 1 or null")
        if self.n_shared_experts < 0 or self.first_k_dense_replace < 0:
            err("n_shared_experts", "n_shared_experts and first_k_dense_replace must be >= 0")
        check(self, err, "qk_rope_head_dim", lambda v: v % 2 == 0, "even for RoPE")
        if self.topk_method not in ("greedy", "group_limited_greedy"):
            err("topk_method", f"expected greedy or group_limited_greedy, got {self.topk_method!r}")
        elif self.topk_method == "group_limited_greedy":
            if self.num_experts % self.n_group:
                err("n_group", f"must divide num_experts ({self.num_experts}), got {self.n_group}")
            elif self.topk_group > self.n_group:
                err("topk_group", f"{self.topk_group} exceeds n_group ({self.n_group})")
            elif self.top_k > self.topk_group * (self.num_experts // self.n_group):
                err("top_k", f"{self.top_k} exceeds the experts in topk_group groups")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            missing = [k for k in ("factor", "original_max_position_embeddings") if k not in self.rope_scaling]
            if kind != "yarn" or missing:
                err("rope_scaling", f"expected a yarn mapping with factor and "
                                    f"original_max_position_embeddings, got {self.rope_scaling!r}")
        self.validate_balance(err)

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    def softmax_scale(self) -> float:
        """(N + R)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (HF's yarn_apply_mscale)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        s = self.rope_scaling or {}
        m, factor = s.get("mscale_all_dim", 0), s.get("factor", 1.0)
        if m and factor > 1:
            scale *= (0.1 * m * math.log(factor) + 1.0) ** 2
        return scale

    # --- parameter and FLOP accounting (pithtrain.metrics uses these)
    def layer_params(self, i: int) -> tuple[int, int]:
        """(total, touched per token) matmul parameters of layer i; router and shared experts count
        in both, routed experts top_k of num_experts."""
        D, H, C = self.hidden_size, self.num_heads, self.kv_lora_rank
        N, R, e, Q = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.q_lora_rank
        q = D * H * (N + R) if Q is None else D * Q + Q * H * (N + R)
        attn = q + D * (C + R) + C * H * (N + e) + H * e * D
        if self.is_moe_layer(i):
            expert = 3 * D * self.moe_intermediate_size
            always = attn + D * self.num_experts + self.n_shared_experts * expert
            return always + self.num_experts * expert, always + self.top_k * expert
        mlp = 3 * D * self.intermediate_size
        return attn + mlp, attn + mlp

    def attention_shapes(self, i: int):
        """(window or None, d_qk, d_v, heads) of layer i."""
        return None, self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim, self.num_heads

    # --- Hugging Face config.json
    @classmethod
    def from_hf(cls, hf: dict) -> "DeepseekV2Config":
        # transformers 5 writes `rope_parameters` (rope_theta inside); published checkpoints have
        # a legacy `rope_scaling` {"type": "yarn", ...} next to a top-level `rope_theta`.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        kind, legacy = rope.pop("rope_type", None), rope.pop("type", None)
        kind = kind or legacy or "default"
        if kind not in ("default", "yarn"):
            raise ValueError(f"rope type {kind!r} is not supported (default, yarn)")
        # Options that transformers' DeepseekV2 does not implement: refuse rather than guess.
        if hf.get("norm_topk_prob"):
            raise ValueError("norm_topk_prob=true: transformers' DeepseekV2 ignores it while "
                             "DeepSeek's original code normalises; refusing to guess")
        if hf.get("num_key_value_heads", hf["num_attention_heads"]) != hf["num_attention_heads"]:
            raise ValueError("MLA needs num_key_value_heads == num_attention_heads")
        for key, ok in (("hidden_act", "silu"), ("mlp_bias", False), ("moe_layer_freq", 1),
                        ("scoring_func", "softmax")):
            if hf.get(key, ok) != ok:
                raise ValueError(f"{key}={hf[key]!r} is not supported (only {ok!r})")
        return cls(
            **fields_from_hf(hf, HF_KEYS), num_experts=hf.get("n_routed_experts", hf.get("num_experts")),
            n_shared_experts=hf.get("n_shared_experts") or 0, topk_method=hf.get("topk_method") or "greedy",
            n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
            rope_theta=theta, rope_scaling=None if kind == "default" else {"rope_type": kind, **rope})

    # The fields to_hf writes and from_hf reads back (tests/test_config.py checks it): HF_KEYS' and
    # those to_hf maps by hand. Any other field that shapes the forward is lost in config.json: export
    # refuses it unless at its default (checkpoint/hf.py).
    hub_fields: ClassVar[tuple] = field_names(HF_KEYS) + (
        "num_experts", "n_shared_experts", "topk_method", "n_group", "topk_group", "rope_theta", "rope_scaling")

    def to_hf(self) -> dict:
        rope = {"rope_type": "default"} if self.rope_scaling is None else dict(self.rope_scaling)
        return {**fields_to_hf(self, HF_KEYS), "num_key_value_heads": self.num_heads,
                "n_routed_experts": self.num_experts, "n_shared_experts": self.n_shared_experts,
                "topk_method": self.topk_method, "n_group": self.n_group, "topk_group": self.topk_group,
                "norm_topk_prob": False, "rope_parameters": {**rope, "rope_theta": self.rope_theta}, "mlp_bias": False}


# ---------------------------------------------------------------------------------------------
# Blocks


def deinterleave(x_BHSR):
    """DeepSeek rotates adjacent pairs (x0, x1), (x2, x3), ...; common.apply_rope rotates
    (x_i, x_{i+R/2}). Gathering evens then odds turns one into the other. q and k get the same
    permutation, so q . k (all attention ever uses) equals DeepSeek's exactly."""
    return torch.cat([x_BHSR[..., 0::2], x_BHSR[..., 1::2]], dim=-1)


class Attention(nn.Module):
    """Multi-head Latent Attention; Hugging Face module names (see the module docstring)."""

    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        D, H, C, Q = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.q_lora_rank
        self.H, self.C, self.N, self.R, self.e = H, C, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        d = self.N + self.R
        if Q is None:
            self.q_proj = nn.Linear(D, H * d, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, Q, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(Q, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(Q, H * d, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, C + self.R, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(C, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(C, H * (self.N + self.e), bias=False)
        self.o_proj = nn.Linear(H * self.e, D, bias=cfg.attention_bias)
        self.scale = cfg.softmax_scale()
        self.use_q_lora = Q is not None
        self.attention = attention  # the one swappable call: context parallel replaces it

    def forward(self, x_BSD, rope):
        B, S, _ = x_BSD.shape
        H, N, R, e = self.H, self.N, self.R, self.e
        q_BSHd = (self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSD))) if self.use_q_lora
                  else self.q_proj(x_BSD))
        q_BHSd = q_BSHd.view(B, S, H, N + R).transpose(1, 2)
        q_nope_BHSN, q_pe_BHSR = q_BHSd.split([N, R], dim=-1)
        c_BSC, k_pe_BSR = self.kv_a_proj_with_mqa(x_BSD).split([self.C, R], dim=-1)
        kv_BHSNe = self.kv_b_proj(self.kv_a_layernorm(c_BSC)).view(B, S, H, N + e).transpose(1, 2)
        k_nope_BHSN, v_BHSe = kv_BHSNe.split([N, e], dim=-1)
        q_pe_BHSR = apply_rope(deinterleave(q_pe_BHSR), rope)
        k_pe_B1SR = apply_rope(deinterleave(k_pe_BSR[:, None]), rope)  # one rope key for all heads
        q_BHSd = torch.cat([q_nope_BHSN, q_pe_BHSR], dim=-1)
        k_BHSd = torch.cat([k_nope_BHSN, k_pe_B1SR.expand(B, H, S, R)], dim=-1)
        o_BHSe = self.attention(q_BHSd, k_BHSd, v_BHSe, scale=self.scale, docs=rope.docs)
        return self.o_proj(o_BHSe.transpose(1, 2).reshape(B, S, H * e))


class MoE(nn.Module):
    """Router, grouped experts, the always-on shared experts and the swappable `dispatcher`
    (LocalDispatcher here; the expert-parallel all-to-all one after `parallelize`). No forward:
    the layer runs the block as its phases (common.mlp_phases: route -> dispatch -> experts, with
    the shared experts -> combine -> residual, which adds both), which call `route` and these parts;
    a variant's code goes there."""

    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.group_limited = cfg.topk_method == "group_limited_greedy"
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (SwiGLUMLP(cfg.hidden_size, cfg.n_shared_experts * cfg.moe_intermediate_size)
                               if cfg.n_shared_experts else None)
        self.dispatcher = LocalDispatcher()
        self.balance = Balance(cfg, cfg.num_experts, cfg.top_k)  # loss, selection bias, load (balance.py)

    def route(self, x_TD):
        """Softmax over all experts in fp32 (as HF); group_limited_greedy first keeps the
        topk_group groups with the highest best-expert score and rules out the others. The
        choice ranks the balancing unit's scores (the probabilities, plus its bias under
        balance=bias, as DeepSeek-V3); the weights are the raw probabilities of the chosen
        experts times routed_scaling_factor (no renormalisation)."""
        logits_TE = F.linear(x_TD.float(), self.gate.weight.float())
        probs_TE = logits_TE.softmax(dim=-1)
        scores_TE = self.balance.choice_scores(probs_TE)
        if self.group_limited:
            T, G = scores_TE.shape[0], self.n_group
            group_TG = scores_TE.view(T, G, -1).amax(dim=-1)
            keep_TG = torch.zeros_like(group_TG, dtype=torch.bool)
            keep_TG.scatter_(1, torch.topk(group_TG, self.topk_group, dim=-1, sorted=False).indices, True)
            keep_TE = keep_TG.repeat_interleave(self.num_experts // G, dim=1)
            scores_TE = scores_TE.masked_fill(~keep_TE, float("-inf"))  # a biased score may be < 0
        idx_TA = torch.topk(scores_TE, self.top_k, dim=-1, sorted=False).indices
        w_TA = probs_TE.gather(1, idx_TA) * self.routed_scaling_factor
        return logits_TE, probs_TE, w_TA.to(x_TD.dtype), idx_TA


# ---------------------------------------------------------------------------------------------
# Model


class DeepseekV2ForCausalLM(CausalLM):
    """common.CausalLM over DeepSeek-V2's blocks (dense SwiGLU in the first first_k_dense_replace
    layers), initialised by DeepSeek's / Hugging Face's scheme (common.init_normal): normal(0,
    initializer_range) for linears (zero biases), embeddings, router and experts; ones for norms.
    RoPE covers only the R decoupled dims; YaRN's cos/sin factor (mscale / mscale_all_dim, 1.0 for
    V2's published 0.707 / 0.707) is applied inside Rotary, the softmax-scale correction in
    Attention.scale."""

    def __init__(self, cfg: DeepseekV2Config):
        super().__init__(cfg, Rotary(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling),
                         ((Attention(cfg), MoE(cfg) if cfg.is_moe_layer(i) else
                           SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)) for i in range(cfg.num_layers)))


# ---------------------------------------------------------------------------------------------
# Hugging Face hub tensors <-> native parameters (pithtrain.checkpoint.hf streams through these)

def hf_to_native(cfg: DeepseekV2Config, hf_key: str, get) -> list[tuple[str, tuple, torch.Tensor]]:
    """(native name, index into it, value) for one hub tensor: per-expert weights fill slices of
    the stacked experts; every other name is the hub name without "model."."""
    if hf_key.endswith("rotary_emb.inv_freq"):  # old remote-code checkpoints store the rope table
        return []
    return per_expert_to_stacked(hf_key, get, cfg.moe_intermediate_size)


def native_to_hf(cfg: DeepseekV2Config, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return stacked_to_per_expert(name, t, cfg.moe_intermediate_size)
