"""Qwen3-MoE: GQA attention with per-head q/k RMSNorm, RoPE, softmax top-k router, SwiGLU experts.

Reads top to bottom: config, attention, MoE block, model (each layer a common.DecoderLayer over
these blocks). Matches Hugging Face's `Qwen3MoeForCausalLM` (tests/test_qwen3_moe.py). Shape
legend: see models/common.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pithtrain.models.balance import Balance, BalanceConfig
from pithtrain.models.common import (CausalLM, GroupedExperts, LocalDispatcher, RMSNorm, Rotary, SwiGLUMLP,
                                     apply_rope, attention, check_sizes)
from pithtrain.models.hub import field_names, fields_from_hf, fields_to_hf, per_expert_to_stacked, stacked_to_per_expert

# ---------------------------------------------------------------------------------------------
# Config

# (field, config.json key[, default when the hub omits it]) beyond hub.COMMON_KEYS; from_hf and
# to_hf map the rest themselves.
HF_KEYS = (("num_kv_heads", "num_key_value_heads"), ("intermediate_size", "intermediate_size"),
           ("moe_intermediate_size", "moe_intermediate_size"), ("top_k", "num_experts_per_tok"),
           ("norm_topk_prob", "norm_topk_prob"), ("decoder_sparse_step", "decoder_sparse_step", 1),
           ("attention_bias", "attention_bias", False), ("aux_loss_coeff", "router_aux_loss_coef", 0.001))


@dataclass
class Qwen3MoeConfig(BalanceConfig):  # + balance, aux_loss_coeff, bias_update_rate, z_loss_coeff
    family: ClassVar[str] = "qwen3_moe"
    hf_architecture: ClassVar[str] = "Qwen3MoeForCausalLM"
    expert_width_field: ClassVar[str] = "moe_intermediate_size"  # one routed expert's hidden width F (w13 is D x 2F)

    vocab_size: int = 264
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384  # dense layers (mlp_only_layers)
    moe_intermediate_size: int = 96
    num_experts: int = 8
    top_k: int = 2
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    init_std: float = 0.02

    def validate(self, err):
        check_sizes(self, err, "vocab_size hidden_size num_layers num_heads num_kv_heads head_dim "
                    "moe_intermediate_size num_experts top_k decoder_sparse_step max_position_embeddings")
        self.validate_balance(err)

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    # --- parameter and FLOP accounting (pithtrain.metrics uses these)
    def layer_params(self, i: int) -> tuple[int, int]:
        """(total, touched per token) matmul parameters of layer i, router included."""
        D, H, K, hd = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = D * H * hd * 2 + D * K * hd * 2
        if self.is_moe_layer(i):
            expert = 3 * D * self.moe_intermediate_size
            router = D * self.num_experts
            return attn + router + self.num_experts * expert, attn + router + self.top_k * expert
        mlp = 3 * D * self.intermediate_size
        return attn + mlp, attn + mlp

    def attention_shapes(self, i: int):
        """(window or None, d_qk, d_v, heads) of layer i."""
        return None, self.head_dim, self.head_dim, self.num_heads

    # --- Hugging Face config.json
    @classmethod
    def from_hf(cls, hf: dict) -> "Qwen3MoeConfig":
        rope = hf.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
            raise ValueError("Qwen3-MoE with scaled RoPE is not supported")
        for key, ok in (("hidden_act", "silu"), ("use_sliding_window", False)):  # else silently wrong
            if hf.get(key, ok) != ok:
                raise ValueError(f"{key}={hf[key]!r} is not supported (only {ok!r})")
        return cls(
            **fields_from_hf(hf, HF_KEYS), num_experts=hf.get("num_experts", hf.get("num_local_experts")),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            mlp_only_layers=list(hf.get("mlp_only_layers") or []),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)))

    # The fields to_hf writes and from_hf reads back (tests/test_config.py checks it): HF_KEYS' and
    # those to_hf maps by hand. Any other field that shapes the forward is lost in config.json: export
    # refuses it unless at its default (checkpoint/hf.py).
    hub_fields: ClassVar[tuple] = field_names(HF_KEYS) + ("head_dim", "num_experts", "mlp_only_layers", "rope_theta")

    def to_hf(self) -> dict:
        return {**fields_to_hf(self, HF_KEYS), "head_dim": self.head_dim, "num_experts": self.num_experts,
                "mlp_only_layers": list(self.mlp_only_layers),
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
                "use_sliding_window": False}


# ---------------------------------------------------------------------------------------------
# Blocks


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__()
        D, H, K, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.H, self.K, self.hd = H, K, hd
        self.q_proj = nn.Linear(D, H * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(D, K * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(D, K * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * hd, D, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.attention = attention  # the one swappable call: context parallel replaces it

    def forward(self, x_BSD, rope):
        B, S, _ = x_BSD.shape
        q_BHSd = self.q_norm(self.q_proj(x_BSD).view(B, S, self.H, self.hd)).transpose(1, 2)
        k_BKSd = self.k_norm(self.k_proj(x_BSD).view(B, S, self.K, self.hd)).transpose(1, 2)
        v_BKSd = self.v_proj(x_BSD).view(B, S, self.K, self.hd).transpose(1, 2)
        q_BHSd, k_BKSd = apply_rope(q_BHSd, rope), apply_rope(k_BKSd, rope)
        o_BHSd = self.attention(q_BHSd, k_BKSd, v_BKSd, scale=self.hd ** -0.5, docs=rope.docs)
        return self.o_proj(o_BHSd.transpose(1, 2).reshape(B, S, self.H * self.hd))


class MoE(nn.Module):
    """Router, grouped experts and the swappable `dispatcher` (LocalDispatcher here; the
    expert-parallel all-to-all one after `parallelize`). No forward: the layer runs the block as
    its phases (common.mlp_phases: route -> dispatch -> experts -> combine), which call `route` and
    these parts; a variant's code goes there."""

    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.top_k, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.dispatcher = LocalDispatcher()
        self.balance = Balance(cfg, cfg.num_experts, cfg.top_k)  # loss, selection bias, load (balance.py)

    def route(self, x_TD):
        """(logits, probabilities, top-k weights, top-k ids); the top-k is chosen on the balancing
        unit's scores (the probabilities, plus its bias under balance=bias), the weights are the
        probabilities of the chosen experts."""
        logits_TE = self.gate(x_TD)
        probs_TE = F.softmax(logits_TE, dim=-1, dtype=torch.float32)
        idx_TA = torch.topk(self.balance.choice_scores(probs_TE), self.top_k, dim=-1).indices
        w_TA = probs_TE.gather(1, idx_TA)
        if self.norm_topk_prob:
            w_TA = w_TA / w_TA.sum(dim=-1, keepdim=True)
        return logits_TE, probs_TE, w_TA.to(x_TD.dtype), idx_TA


# ---------------------------------------------------------------------------------------------
# Model


class Qwen3MoeForCausalLM(CausalLM):
    """common.CausalLM over Qwen3-MoE's blocks (dense SwiGLU where not is_moe_layer), initialised by
    Hugging Face's scheme: normal(0, initializer_range), ones for norms."""

    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__(cfg, Rotary(cfg.head_dim, cfg.rope_theta),
                         ((Attention(cfg), MoE(cfg) if cfg.is_moe_layer(i) else
                           SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)) for i in range(cfg.num_layers)))


# ---------------------------------------------------------------------------------------------
# Hugging Face hub tensors <-> native parameters (pithtrain.checkpoint.hf streams through these)

def hf_to_native(cfg: Qwen3MoeConfig, hf_key: str, get) -> list[tuple[str, tuple, torch.Tensor]]:
    """(native name, index into it, value) for one hub tensor: per-expert weights fill slices of
    the stacked experts; every other name is the hub name without "model."."""
    return per_expert_to_stacked(hf_key, get, cfg.moe_intermediate_size)


def native_to_hf(cfg: Qwen3MoeConfig, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return stacked_to_per_expert(name, t, cfg.moe_intermediate_size)
