"""Expert load balancing: one unit per MoE block, chosen by the recipe.

    model:
      balance: bias            # switch | sequence | bias | none
      bias_update_rate: 0.001  # bias only
      z_loss_coeff: 0.0        # any strategy: the router z-loss add-on
      # aux_loss_coeff: 0.01   # switch and sequence only

Strategies (E experts, A top-k slots, f_e the share of routed slots sent to e, P_e the mean
router probability of e; both 1/E when balanced, so the losses are 1 then):
  switch    Switch Transformer's batch loss, E * sum_e f_e * P_e over the micro-batch's tokens.
  sequence  DeepSeek-V2's sequence-level loss: the same over each sequence's own tokens, averaged
            over the sequences (the `seq_aux` branch of DeepSeek's MoEGate; transformers'
            DeepseekV2 has no auxiliary loss).
  bias      DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias is added to the scores
            the router ranks for its top-k choice only (the gate weights stay the unbiased
            probabilities); after each optimizer step b_e += rate * sign(mean load - load_e) from
            the load of the whole global batch. `bias_E` is a persistent buffer: it checkpoints,
            starts at zero (and so imports as zero from the hub).
  none      nothing.
  z-loss    with any strategy, ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2.

The unit's interface (the MoE block's `route` and common.route_tokens call it; the trainer calls
distributed/reductions.balance_after_step after the optimizer step):
  choice_scores(scores_TE)   what the router ranks for its top-k choice (the bias added).
  observe(logits_TE, probs_TE, idx_TA, sequences, count, loss)
                             route_tokens' one call per routed micro-batch: `count` (when asked)
                             and `loss` (when asked, else None). compile.apply_compile compiles
                             it with the router as one graph (common.route_and_observe), so its
                             dozen small operations run as a few fused kernels.
  loss(logits_TE, probs_TE, idx_TA, sequences)   the coefficient-weighted loss for AuxLoss, or None.
  count(idx_TA)              this micro-batch's routing into `stats`, once per micro-batch
                             (route_tokens skips a forward that activation checkpointing
                             recomputes in backward).
  update(load_E)             after the optimizer step, from the load summed over every rank.
  stats_sum                  sums a loss's detached statistics over the tokens of one micro-batch:
                             the identity here; context parallel puts an all-reduce over its ranks.

A new strategy: its name in `Strategy`, its knob (if any) in BalanceConfig with its check in
`validate_balance`, its branch below, a test in tests/test_balance.py, and a new knob's name in
config.RECIPE_MODEL_FIELDS (a training-only field the recipe keeps over train.init_from).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from pithtrain import check

Strategy = Literal["switch", "sequence", "bias", "none"]
# Which knob applies to which strategy; one set to a non-default value elsewhere is a config error.
APPLIES = {"aux_loss_coeff": ("switch", "sequence"), "bias_update_rate": ("bias",)}


@dataclass
class BalanceConfig:
    """The balancing fields every family config inherits (recipe keys of the model section)."""

    balance: Strategy = "switch"
    # Switch Transformer's 0.01 (the default recipe's; at 0.001 its tiny model's load collapses to
    # 2 of 8 experts). The hub-shaped recipes state their checkpoints' 0.001.
    aux_loss_coeff: float = 0.01
    bias_update_rate: float = 0.001
    z_loss_coeff: float = 0.0

    def validate_balance(self, err):
        if self.balance not in ("switch", "sequence", "bias", "none"):
            err("balance", f"expected switch, sequence, bias or none, got {self.balance!r}")
            return
        check(self, err, "aux_loss_coeff bias_update_rate z_loss_coeff", lambda v: 0 <= v < math.inf,
              "a finite number >= 0")
        defaults = {f.name: f.default for f in dataclasses.fields(BalanceConfig)}
        for k, strategies in APPLIES.items():
            if self.balance not in strategies and getattr(self, k) != defaults[k]:
                err(k, f"does not apply to balance={self.balance} (only to {' and '.join(strategies)}); "
                       f"remove it from the recipe or set it to its default, {defaults[k]}")


class Balance(nn.Module):
    """One MoE block's load balancing (see the module docstring). E is the router's width (the ids
    it scores: it may exceed the FFN experts, models/common.py's router contract). Buffers: `bias_E`
    (E,) float32 for `bias` (persistent); `stats` (E + A + 1,) int64, this step's routing on this
    rank so far: kept slots per id (the load), then how many tokens kept 0..A slots. A slot is kept
    unless its id is common.DROPPED (-1). Not saved: it is zero after every step."""

    def __init__(self, cfg: BalanceConfig, num_experts: int, top_k: int):
        super().__init__()
        self.strategy, self.num_experts, self.top_k = cfg.balance, num_experts, top_k
        self.aux_loss_coeff = cfg.aux_loss_coeff if cfg.balance in APPLIES["aux_loss_coeff"] else 0.0
        self.bias_update_rate = cfg.bias_update_rate
        self.z_loss_coeff = cfg.z_loss_coeff
        if cfg.balance == "bias":
            self.register_buffer("bias_E", torch.empty(num_experts, dtype=torch.float32))
        else:
            self.bias_E = None
        self.register_buffer("stats", torch.empty(num_experts + top_k + 1, dtype=torch.int64),
                             persistent=False)
        self.stats_sum = local_sum  # context parallel: an all-reduce over the cp group
        self.loss_scale = 1.0  # the trainer's 1 / micro-batches of the global batch (common.AuxLoss)

    @torch.no_grad()
    def reset_parameters(self):
        if self.bias_E is not None:
            self.bias_E.zero_()
        self.stats.zero_()

    def choice_scores(self, scores_TE):
        """The scores the top-k choice ranks: the router's own, plus the bias under `bias`."""
        return scores_TE if self.bias_E is None else scores_TE + self.bias_E

    def loss(self, logits_TE, probs_TE, idx_TA, sequences: int | None = None):
        """coeff * balancing loss + z_coeff * z-loss of one micro-batch (T = sequences * S rows,
        sequence-major), or None when neither applies. Under context parallel each rank returns
        its share: statistics are summed over the ranks (stats_sum) and each rank's probability
        and z sums are divided by the whole micro-batch's token count, so the shares add up to
        the one-process loss, and so do their gradients."""
        aux = self.aux_loss_coeff > 0
        if not aux and not self.z_loss_coeff > 0:
            return None
        T, A = idx_TA.shape
        E = self.num_experts
        if self.strategy == "sequence" and aux:
            if sequences is None or T % sequences:
                raise ValueError(f"balance=sequence needs the number of sequences in the {T} routed "
                                 f"rows (route_tokens(moe, x_TD, sequences=B)), got {sequences}")
            B = sequences
        else:
            B = 1  # switch: the whole micro-batch is one group; z-loss only needs the token count
        kept = (idx_TA >= 0).float().reshape(B, -1)  # f_e counts kept slots (DROPPED: -1)
        counts_BE = torch.zeros(B, E, device=idx_TA.device).scatter_add_(1, idx_TA.clamp(min=0).reshape(B, -1), kept)
        stats = self.stats_sum(torch.cat([counts_BE.flatten(), kept.new_full((1,), T / B)]))
        S = stats[-1]  # tokens per group over the whole micro-batch (every cp rank's chunk)
        total = logits_TE.new_zeros((), dtype=torch.float32)
        if aux:
            f_BE = stats[:-1].view(B, E) / (S * A)
            P_BE = probs_TE.float().view(B, -1, E).sum(1) / S
            total = total + self.aux_loss_coeff * E * (f_BE * P_BE).sum(1).mean()
        if self.z_loss_coeff > 0:
            z_T = torch.logsumexp(logits_TE.float(), dim=-1)
            total = total + self.z_loss_coeff * z_T.pow(2).sum() / (S * B)
        return total

    def observe(self, logits_TE, probs_TE, idx_TA, sequences: int | None, count: bool, loss: bool):
        """One routed micro-batch: its routing into `stats` when `count`, and its loss when `loss`
        (else None). One call so that compile fuses both (apply_compile)."""
        if count:
            self.count(idx_TA)
        return self.loss(logits_TE, probs_TE, idx_TA, sequences) if loss else None

    def count(self, idx_TA):
        """Add this micro-batch's kept slots per id and kept slots per token to `stats` (the
        caller skips a recomputed forward, which would double the load). No host sync:
        scatter_add only."""
        E = self.num_experts
        kept_TA = (idx_TA >= 0).long()  # common.DROPPED is -1
        self.stats[:E].scatter_add_(0, idx_TA.clamp(min=0).reshape(-1), kept_TA.reshape(-1))
        kept_T = kept_TA.sum(1)
        self.stats[E:].scatter_add_(0, kept_T, torch.ones_like(kept_T))

    @torch.no_grad()
    def update(self, load_E):
        """After the optimizer step, with this step's load summed over every rank (identical on
        all ranks, so every rank's bias stays identical): b_e += rate * sign(mean - load_e)."""
        if self.bias_E is not None:
            load = load_E.to(self.bias_E.device, torch.float64)
            self.bias_E += (self.bias_update_rate * torch.sign(load.mean() - load)).to(self.bias_E.dtype)


def reset_step_stats(model: nn.Module) -> None:
    """Start the next step's statistics: each MoE block's balancing counts (`Balance.stats`) and its
    experts' `rows_computed` (the train step calls it after the balancing update, or instead of it
    on a skipped step)."""
    for m in model.modules():
        if isinstance(getattr(m, "balance", None), Balance):
            m.balance.stats.zero_()
            m.experts.rows_computed = 0


def local_sum(t):
    """`stats_sum` when one rank holds the micro-batch's tokens: nothing to sum."""
    return t
