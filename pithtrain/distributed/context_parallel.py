"""Context parallelism: the cp ranks of a batch rank split each sequence and attend across it.

Load balancing. Causal attention makes late queries dearer than early ones, so the sequence is
cut into 2*cp equal chunks and cp rank i holds chunks i and 2cp-1-i (one cheap, one dear):

    cp=2, S=8:  chunks [01][23][45][67]   rank 0 -> 01 67   rank 1 -> 23 45

`shard_sequence` applies this to a (B, S) batch (tokens, labels, and the absolute positions the
model's RoPE needs). Everything outside attention is per token and needs nothing else.

Attention. `ContextParallelAttention` replaces `models.common.attention` on each attention
module (the `attention` attribute). It all-gathers K and V from the cp ranks (autograd: the
backward sums the K/V gradients of every rank and keeps the local chunks), puts them in sequence
order, and runs each local query chunk against the keys up to its end with an explicit offset
mask, so GQA (SDPA), MLA (different V width: any K/V widths pass through) and sliding window
with sinks (eager_attention) keep exactly their single-device masking. Heads are not split, so
heads need not divide by cp. K/V are gathered whole: memory grows with S, compute is balanced.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pithtrain.models.common import eager_attention


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_sequence(x_BS: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """(B, S) -> (B, S/cp): this rank's two chunks, in order."""
    chunks = x_BS.chunk(2 * cp, dim=1)
    return torch.cat([chunks[i] for i in chunk_ids(cp_rank, cp)], dim=1)


def split_batch(x_BS, y_BS, dims):
    """(tokens, labels, positions) of this rank: its two chunks when cp > 1, else unchanged with
    positions None (the model's default 0..S-1)."""
    if not dims.cp_enabled:
        return x_BS, y_BS, None
    pos_BS = torch.arange(x_BS.shape[1], device=x_BS.device).expand_as(x_BS)  # absolute positions
    return tuple(shard_sequence(t_BS, dims.cp_rank, dims.cp) for t_BS in (x_BS, y_BS, pos_BS))


class _GatherSequence(torch.autograd.Function):
    """(B, K, S/cp, d) local -> (cp, B, K, S/cp, d) from every rank (all-gather). Backward: every
    rank holds gradients for all ranks' K/V; a reduce-scatter sums them and hands each rank its
    own slice."""

    @staticmethod
    def forward(ctx, x, group, size: int):
        ctx.group = group
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))  # rank-major along dim 0
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.contiguous().flatten(0, 1), group=ctx.group)
        return out, None, None


class ContextParallelAttention:
    """Drop-in for models.common.attention(q, k, v, *, scale, window, sinks_H) on local chunks."""

    def __init__(self, group, cp_rank: int, cp: int):
        self.group, self.cp_rank, self.cp = group, cp_rank, cp

    def gather(self, x_BKsd):
        """Local (B, K, S/cp, d) -> the whole sequence (B, K, S, d) in position order."""
        cp = self.cp
        parts = _GatherSequence.apply(x_BKsd, self.group, cp)  # (cp, B, K, S/cp, d)
        chunks = [None] * (2 * cp)
        for r in range(cp):  # where each rank's two chunks go: chunk_ids, the one rule of the layout
            a, b = chunk_ids(r, cp)
            chunks[a], chunks[b] = parts[r].chunk(2, dim=2)
        return torch.cat(chunks, dim=2)

    def __call__(self, q_BHsd, k_BKsd, v_BKse, *, scale: float, window: int | None = None,
                 sinks_H: torch.Tensor | None = None, docs=None):
        if docs is not None:  # the config refuses data.document_mask with cp > 1
            raise NotImplementedError("document masking with context parallel")
        k_BKSd, v_BKSe = self.gather(k_BKsd), self.gather(v_BKse)
        c = q_BHsd.shape[2] // 2  # chunk length
        outs = []
        for q_chunk, chunk in zip(q_BHsd.chunk(2, dim=2), chunk_ids(self.cp_rank, self.cp)):
            start, end = chunk * c, (chunk + 1) * c
            # Keys a query of this chunk can see: causal up to `end`, and the window if any.
            k0 = 0 if window is None else max(0, start - window + 1)
            k, v = k_BKSd[:, :, k0:end], v_BKSe[:, :, k0:end]
            if window is None and sinks_H is None:
                qi = torch.arange(start, end, device=q_chunk.device)[:, None]
                kj = torch.arange(k0, end, device=q_chunk.device)[None, :]
                outs.append(F.scaled_dot_product_attention(
                    q_chunk, k, v, attn_mask=kj <= qi, scale=scale,
                    enable_gqa=k.shape[1] != q_chunk.shape[1]))
            else:
                outs.append(eager_attention(q_chunk, k, v, scale=scale, window=window,
                                            sinks_H=sinks_H, q_offset=start - k0))
        return torch.cat(outs, dim=2)


class ContextParallelSum:
    """Drop-in for each MoE block's `balance.stats_sum` (models/balance.py) when the cp ranks
    split a micro-batch's sequences: the detached statistics of the balancing and z losses
    (slots per expert and per sequence, token counts) are summed over the cp group, so each rank
    computes its share of the whole micro-batch's loss (the shares add up to the one-process loss)."""

    def __init__(self, group):
        self.group = group

    def __call__(self, stats):
        dist.all_reduce(stats, group=self.group)
        return stats
