"""GPT-OSS: GQA attention with learned sinks, alternating sliding-window / full layers, YaRN RoPE,
biases everywhere, a biased top-k router (softmax over the top-k logits) and clamped-SwiGLU experts.

Reads top to bottom: config, MXFP4 dequantisation, attention, MoE block, model (each layer a
common.DecoderLayer over these blocks), hub mapping. Matches Hugging Face's `GptOssForCausalLM`
(tests/test_gpt_oss.py). Shape legend: see models/common.py; G MXFP4 blocks of 32 values per row.

Layout difference from the hub: HF keeps the expert up-projection interleaved
(gate_up_proj[..., 0::2] = gate, [..., 1::2] = up); we keep common.GroupedExperts' concatenated
[gate | up] layout and (de-)interleave in hf_to_native / native_to_hf.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pithtrain import check
from pithtrain.models.balance import Balance, BalanceConfig
from pithtrain.models.common import (CausalLM, GroupedExperts, LocalDispatcher, Rotary, apply_rope, attention,
                                     check_sizes, init_normal)
from pithtrain.models.hub import field_names, fields_from_hf, fields_to_hf, hub_name, native_name

LAYER_TYPES = ("sliding_attention", "full_attention")
# (field, config.json key[, default when the hub omits it]) beyond hub.COMMON_KEYS; from_hf and
# to_hf map the rest themselves.
HF_KEYS = (("num_kv_heads", "num_key_value_heads"), ("intermediate_size", "intermediate_size"),
           ("sliding_window", "sliding_window"), ("attention_bias", "attention_bias", True),
           ("swiglu_limit", "swiglu_limit", 7.0))


# ---------------------------------------------------------------------------------------------
# Config


@dataclass
class GptOssConfig(BalanceConfig):  # + balance, aux_loss_coeff, bias_update_rate, z_loss_coeff
    family: ClassVar[str] = "gpt_oss"
    hf_architecture: ClassVar[str] = "GptOssForCausalLM"
    expert_width_field: ClassVar[str] = "intermediate_size"  # one routed expert's hidden width F (w13 is D x 2F)
    # OpenAI's model card counts the unembedding but not the embedding lookup as active
    # (gpt-oss-20b: 3.6B active); metrics.param_counts reads this.
    active_counts_embedding: ClassVar[bool] = False

    vocab_size: int = 264
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 96  # per expert
    num_experts: int = 8
    top_k: int = 2
    sliding_window: int = 128
    layer_types: list = field(default_factory=list)  # empty: sliding on even layers, full on odd (HF)
    attention_bias: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rope_theta: float = 150_000.0
    yarn_factor: float | None = 32.0  # None: plain RoPE
    yarn_original_max_position: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_truncate: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    init_std: float = 0.02

    def validate(self, err):
        check_sizes(self, err, "vocab_size hidden_size num_layers num_heads num_kv_heads head_dim intermediate_size "
                    "num_experts top_k sliding_window max_position_embeddings yarn_original_max_position")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            err("layer_types", f"has {len(self.layer_types)} entries for {self.num_layers} layers")
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                err("layer_types", f"unknown layer type {t!r} (allowed: {', '.join(LAYER_TYPES)})")
        check(self, err, "yarn_factor", lambda v: v >= 1, ">= 1 (or null for plain RoPE)")
        self.validate_balance(err)

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else LAYER_TYPES[i % 2]

    def window(self, i: int) -> int | None:
        """Keys within the last `sliding_window` positions (self included) on sliding layers."""
        return self.sliding_window if self.layer_type(i) == "sliding_attention" else None

    def rope_scaling(self) -> dict | None:
        """The Hugging Face rope dict that common.rope_inv_freq reads."""
        if self.yarn_factor is None:
            return None
        return {"rope_type": "yarn", "factor": self.yarn_factor,
                "original_max_position_embeddings": self.yarn_original_max_position,
                "beta_fast": self.yarn_beta_fast, "beta_slow": self.yarn_beta_slow,
                "truncate": self.yarn_truncate}

    # --- parameter and FLOP accounting (pithtrain.metrics uses these)
    def layer_params(self, i: int) -> tuple[int, int]:
        """(total, touched per token) parameters of layer i's linear maps, biases included, router
        included (so that param_counts' inactive experts are exact; biases are ~0.03% of FLOPs)."""
        D, H, K, hd, E, F_ = (self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                              self.num_experts, self.intermediate_size)
        attn = D * H * hd * 2 + D * K * hd * 2
        if self.attention_bias:
            attn += H * hd + 2 * K * hd + D
        router = D * E + E
        expert = 3 * D * F_ + 2 * F_ + D
        return attn + router + E * expert, attn + router + self.top_k * expert

    def attention_shapes(self, i: int):
        """(window or None, d_qk, d_v, heads) of layer i."""
        return self.window(i), self.head_dim, self.head_dim, self.num_heads

    # --- Hugging Face config.json
    @classmethod
    def from_hf(cls, hf: dict) -> "GptOssConfig":
        # transformers >= 5 writes rope_parameters; published checkpoints have rope_scaling + rope_theta
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 150_000.0))
        kind = rope.pop("rope_type", rope.pop("type", "default"))
        if kind not in ("yarn", "default"):
            raise ValueError(f"rope type {kind!r} is not supported for GPT-OSS (supported: yarn, default)")
        unknown = set(rope) - {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                               "truncate"}
        if kind == "yarn" and unknown:
            raise ValueError(f"unsupported YaRN parameters {sorted(unknown)}")
        n = hf["num_hidden_layers"]
        return cls(
            **fields_from_hf(hf, HF_KEYS), num_experts=hf.get("num_local_experts", hf.get("num_experts")),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            top_k=hf.get("num_experts_per_tok", hf.get("experts_per_token")),
            layer_types=list(hf.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(n)]), rope_theta=theta,
            yarn_factor=rope.get("factor", 32.0) if kind == "yarn" else None,
            yarn_original_max_position=rope.get("original_max_position_embeddings", 4096),
            yarn_beta_fast=rope.get("beta_fast") or 32.0, yarn_beta_slow=rope.get("beta_slow") or 1.0,
            yarn_truncate=rope.get("truncate", True),
            # HF adds the load-balancing loss only with output_router_logits; the published configs
            # carry an inert router_aux_loss_coef of 0.9 with it off, so take the hub-scale 0.001 then
            aux_loss_coeff=hf.get("router_aux_loss_coef", 0.001) if hf.get("output_router_logits") else 0.001)

    # The fields to_hf writes and from_hf reads back (tests/test_config.py checks it): HF_KEYS' and
    # those to_hf maps by hand. Any other field that shapes the forward is lost in config.json: export
    # refuses it unless at its default (checkpoint/hf.py).
    hub_fields: ClassVar[tuple] = field_names(HF_KEYS) + (  # not swiglu_alpha: transformers fixes it at 1.702
        "head_dim", "num_experts", "top_k", "layer_types", "rope_theta", "yarn_factor", "yarn_original_max_position",
        "yarn_beta_fast", "yarn_beta_slow", "yarn_truncate", "aux_loss_coeff")

    def to_hf(self) -> dict:
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.yarn_factor is not None:
            rope = {**self.rope_scaling(), "rope_theta": self.rope_theta}
        return {**fields_to_hf(self, HF_KEYS), "head_dim": self.head_dim, "num_local_experts": self.num_experts,
                "num_experts_per_tok": self.top_k, "layer_types": [self.layer_type(i) for i in range(self.num_layers)],
                "rope_parameters": rope, "router_aux_loss_coef": self.aux_loss_coeff}


# ---------------------------------------------------------------------------------------------
# MXFP4 (hub expert weights): 32-value blocks of FP4 e2m1 codes, two per byte (low nibble first),
# one e8m0 scale byte per block (2 ** (s - 127)).

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks_ERGB, scales_ERG, dtype=torch.float32):
    """(E, R, G, 16) uint8 codes + (E, R, G) uint8 scales -> (E, R, G*32) values, R the hub
    weight's output rows. One expert at a time, to keep the temporaries small. On the meta device
    it gives the shape only (the sharded import plans its reads that way)."""
    E, R, G, B = blocks_ERGB.shape
    if tuple(scales_ERG.shape) != (E, R, G):
        raise ValueError(f"MXFP4 scales of shape {tuple(scales_ERG.shape)} do not match blocks "
                         f"of shape {tuple(blocks_ERGB.shape)}")
    lut = torch.tensor(FP4_E2M1, dtype=dtype, device=blocks_ERGB.device)
    out_ERC = torch.empty(E, R, G, 2 * B, dtype=dtype, device=blocks_ERGB.device)
    for e in range(E):
        codes = blocks_ERGB[e].to(torch.int64)
        out_ERC[e, ..., 0::2] = lut[codes & 0x0F]
        out_ERC[e, ..., 1::2] = lut[codes >> 4]
        torch.ldexp(out_ERC[e], scales_ERG[e].to(torch.int32)[..., None] - 127, out=out_ERC[e])
    return out_ERC.reshape(E, R, G * 2 * B)


# ---------------------------------------------------------------------------------------------
# Blocks


class Attention(nn.Module):
    def __init__(self, cfg: GptOssConfig, i: int):
        super().__init__()
        D, H, K, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.H, self.K, self.hd, self.window = H, K, hd, cfg.window(i)
        self.q_proj = nn.Linear(D, H * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(D, K * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(D, K * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * hd, D, bias=cfg.attention_bias)
        self.sinks_H = nn.Parameter(torch.empty(H))  # per-head logit of a virtual key with value 0
        self.attention = attention  # the one swappable call: context parallel replaces it

    def forward(self, x_BSD, rope):
        B, S, _ = x_BSD.shape
        q_BHSd = self.q_proj(x_BSD).view(B, S, self.H, self.hd).transpose(1, 2)
        k_BKSd = self.k_proj(x_BSD).view(B, S, self.K, self.hd).transpose(1, 2)
        v_BKSd = self.v_proj(x_BSD).view(B, S, self.K, self.hd).transpose(1, 2)
        q_BHSd, k_BKSd = apply_rope(q_BHSd, rope), apply_rope(k_BKSd, rope)
        o_BHSd = self.attention(q_BHSd, k_BKSd, v_BKSd, scale=self.hd ** -0.5, window=self.window,
                                sinks_H=self.sinks_H, docs=rope.docs)
        return self.o_proj(o_BHSd.transpose(1, 2).reshape(B, S, self.H * self.hd))


class MoE(nn.Module):
    """Router, grouped experts and the swappable `dispatcher` (LocalDispatcher here; the
    expert-parallel all-to-all one after `parallelize`). No forward: the layer runs the block as
    its phases (common.mlp_phases: route -> dispatch -> experts -> combine), which call `route` and
    these parts; a variant's code goes there."""

    def __init__(self, cfg: GptOssConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size,
                                      bias=True, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
        self.dispatcher = LocalDispatcher()
        self.balance = Balance(cfg, cfg.num_experts, cfg.top_k)  # loss, selection bias, load (balance.py)

    def route(self, x_TD):
        """Top-k on the logits (plus the balancing unit's bias under balance=bias), then softmax
        over the k chosen logits only (GPT-OSS, as HF). The probabilities returned, for the
        load-balancing loss, are HF's: softmax over all experts."""
        logits_TE = self.router(x_TD)
        idx_TA = torch.topk(self.balance.choice_scores(logits_TE), self.top_k, dim=-1).indices
        w_TA = F.softmax(logits_TE.gather(1, idx_TA), dim=-1, dtype=torch.float32)
        return logits_TE, F.softmax(logits_TE, dim=-1, dtype=torch.float32), w_TA.to(x_TD.dtype), idx_TA


# ---------------------------------------------------------------------------------------------
# Model


class GptOssForCausalLM(CausalLM):
    """common.CausalLM over GPT-OSS's blocks (every layer MoE; sliding or full attention by layer_type)."""

    def __init__(self, cfg: GptOssConfig):
        super().__init__(cfg, Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling()),
                         ((Attention(cfg, i), MoE(cfg)) for i in range(cfg.num_layers)))

    @torch.no_grad()
    def init_block(self, block):
        """Hugging Face's GPT-OSS scheme: normal(0, initializer_range) for linear weights,
        embeddings, experts, sinks and the router (weight and bias); zeros for the other biases;
        ones for norms."""
        std = self.cfg.init_std
        init_normal(block, std)
        for m in block.modules():  # after init_normal zeroed every Linear bias
            if isinstance(m, Attention):
                nn.init.normal_(m.sinks_H, std=std)
            elif isinstance(m, MoE):
                nn.init.normal_(m.router.bias, std=std)


# ---------------------------------------------------------------------------------------------
# Hugging Face hub tensors <-> native parameters (pithtrain.checkpoint.hf streams through these).
# Hub experts are fused per layer: gate_up_proj (E, D, 2F) interleaved, gate_up_proj_bias (E, 2F)
# interleaved, down_proj (E, F, D), down_proj_bias (E, D); published checkpoints store the two
# weights as MXFP4 `<name>_blocks` (E, out, G, 16) + `<name>_scales` (E, out, G), out-major.

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")
_SINKS = re.compile(r"model\.layers\.(\d+)\.self_attn\.sinks")


def deinterleave(t_EX2):
    """[g0, u0, g1, u1, ...] on the last dim -> [g0, g1, ... | u0, u1, ...]."""
    return torch.cat([t_EX2[..., 0::2], t_EX2[..., 1::2]], dim=-1)


def interleave(t_EX2):
    gate, up = t_EX2.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def hf_to_native(cfg: GptOssConfig, hf_key: str, get) -> list[tuple[str, tuple, torch.Tensor]]:
    """(native name, index into it, value) for one hub tensor; raises KeyError for unknown keys."""
    if m := _SINKS.fullmatch(hf_key):
        return [(f"layers.{m[1]}.self_attn.sinks_H", (), get(hf_key))]
    m = _EXPERT.fullmatch(hf_key)
    if m is None:
        return [(native_name(hf_key), (), get(hf_key))]
    base, proj, suffix = f"layers.{m[1]}.mlp.experts.", m[2], m[3]
    if suffix == "_scales":
        return []  # read together with its _blocks
    if suffix == "_bias":
        b = get(hf_key)
        return [(base + "b13_EF2", (), deinterleave(b))] if proj == "gate_up_proj" else [(base + "b2_ED", (), b)]
    if suffix == "_blocks":
        w = dequantize_mxfp4(get(hf_key), get(hf_key[: -len("_blocks")] + "_scales")).transpose(1, 2)
    else:
        w = get(hf_key)
    return [(base + "w13_EDF2", (), deinterleave(w))] if proj == "gate_up_proj" else [(base + "w2_EFD", (), w)]


def native_to_hf(cfg: GptOssConfig, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Dense hub tensors (no MXFP4 on export: transformers loads dense GPT-OSS directly)."""
    prefix, _, leaf = name.rpartition(".")
    if leaf == "sinks_H":
        return [(hub_name(prefix + ".sinks"), t)]
    hub_leaf = {"w13_EDF2": "gate_up_proj", "b13_EF2": "gate_up_proj_bias", "w2_EFD": "down_proj",
                "b2_ED": "down_proj_bias"}.get(leaf)
    if hub_leaf is None:
        return [(hub_name(name), t)]
    if leaf in ("w13_EDF2", "b13_EF2"):
        t = interleave(t)
    return [(hub_name(f"{prefix}.{hub_leaf}"), t)]
