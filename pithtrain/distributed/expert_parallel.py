"""Expert-parallel dispatch and combine: the all-to-all replacement of models.common.LocalDispatcher.

The ep ranks of a group each hold E/ep routed experts (rank r: experts [r*E/ep, (r+1)*E/ep)).
Every rank routes its own tokens; a token's top-k experts may live on other ranks.

    dispatch   rank-major send buffer: ONE row per (token, destination rank) -- deduplicated: a
               token whose k experts include two on rank r crosses the network once, with its
               k (expert id, weight) slots; slots for other ranks are masked (-1, 0). Slots the
               experts do not compute (models.common.computed_slots: DROPPED, or an id past the
               experts) go to no rank: a token with none to compute is not sent at all.
               all-to-all #1 the row counts, #2 rows+weights (autograd), #3 expert ids.
    expand     on the receiving rank: one pair per (row, local slot), sorted by local expert
               (stable) = the expert-contiguous layout the grouped matmul wants: the one-GPU
               LocalDispatcher over the received rows, their other ranks' slots DROPPED (its
               Triton gathers on CUDA, no atomics).
    experts    experts(x_PD, counts_E) -- the module call, between the two (a phase of its own).
    combine    weighted sum of a row's pairs on the receiving rank (LocalDispatcher.combine), then
               all-to-all #4 back in reverse splits, and index_add into the token positions (a
               token sent to two ranks sums two partial mixtures). Host reads: the split sizes
               once, the local pairs' count once (the drops), per dispatch.

Gradients: AllToAll's backward is the reverse all-to-all; everything else (gather, index_add,
masking) is ordinary autograd, so router weights receive their gradient through the sent
weights and the experts' gradients include the tokens of every rank of the group.

Shape legend: T local tokens, A top-k slots, D width, R ep ranks, X sent rows, N received rows,
P received (row, slot) pairs, E local experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pithtrain.models.common import DROPPED, LocalDispatcher, computed_slots


class AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 with uneven splits; backward runs the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


class ExpertParallelDispatcher:
    """Same methods as LocalDispatcher: dispatch and combine, each one communication phase of
    common.mlp_phases (the experts phase between them runs this rank's E/ep experts, whose
    parameters are DTensors sharded by expert; see parallelize.py).
    Counters `rows_sent` / `rows_sent_remote` (rows leaving this rank in total / to other ranks)
    accumulate over calls, for tests and profiling."""

    def __init__(self, group, ep_rank: int, ep_size: int, num_experts: int, fused: bool = False):
        assert num_experts % ep_size == 0
        self.group, self.ep_rank, self.ep_size = group, ep_rank, ep_size
        self.local_experts = num_experts // ep_size
        self.rows_sent = self.rows_sent_remote = 0
        # The received rows' slots for this rank's experts, expert-contiguous, and their weighted sum
        # back per row: the one-GPU dispatcher over them (the others are DROPPED slots), with its
        # Triton gathers where `fused` (the LocalDispatcher this one replaces had them)
        self.local = LocalDispatcher(drops=True)
        self.local.fused = fused

    def dispatch(self, x_TD, idx_TA, w_TA, num_experts):
        """-> (x_PD: the received (row, local slot) pairs in expert-contiguous order, w_NA: the
        received rows' weights, counts_E per local expert, info for combine). One communication
        phase: the row counts, then the rows with their weights (differentiable) and their ids."""
        T, A = idx_TA.shape
        R, El = self.ep_size, self.local_experts
        dest_TA = torch.where(computed_slots(idx_TA, R * El), idx_TA // El, R)  # R: to no rank

        # --- send buffer, rank-major: row X goes to rank r_X and carries token t_X
        # One host read per dispatch for the split sizes (the counts go first, on the device)
        need_RT = torch.zeros(R + 1, T, dtype=torch.bool, device=x_TD.device)  # token t goes to rank r
        need_RT[dest_TA.reshape(-1), torch.arange(T, device=x_TD.device).repeat_interleave(A)] = True
        send_R = need_RT[:R].sum(1)
        recv_R = torch.empty_like(send_R)
        dist.all_to_all_single(recv_R, send_R, group=self.group)
        splits = torch.cat([send_R, recv_R]).tolist()
        in_splits, out_splits = splits[:R], splits[R:]
        # the rows, sorted by rank, then token; their number is known now: no second read
        r_X, t_X = torch.nonzero_static(need_RT[:R], size=sum(in_splits)).unbind(1)
        keep_XA = dest_TA[t_X] == r_X[:, None]  # every slot of the token bound for r_X
        idx_XA = torch.where(keep_XA, idx_TA[t_X], -1)
        w_XA = torch.where(keep_XA, w_TA[t_X].to(x_TD.dtype), 0)
        self.rows_sent += len(t_X)
        self.rows_sent_remote += len(t_X) - in_splits[self.ep_rank]

        # --- exchange rows with their weights (one differentiable all-to-all) and expert ids
        D = x_TD.shape[1]
        payload_N = AllToAll.apply(torch.cat([x_TD[t_X], w_XA], dim=1), out_splits, in_splits, self.group)
        x_ND, w_NA = payload_N[:, :D], payload_N[:, D:]
        idx_NA = idx_XA.new_empty((sum(out_splits), A))
        dist.all_to_all_single(idx_NA, idx_XA.contiguous(), out_splits, in_splits, group=self.group)

        # --- expand to (row, local expert) pairs in expert-contiguous order: the received rows
        # through the one-GPU dispatcher, their slots for other ranks' experts DROPPED
        local_NA = idx_NA - self.ep_rank * El
        local_NA = torch.where((idx_NA >= 0) & (local_NA >= 0) & (local_NA < El), local_NA, DROPPED)
        x_PD, w_NA, counts_E, local = self.local.dispatch(x_ND, local_NA, w_NA, El)
        return x_PD, w_NA, counts_E, (local, in_splits, out_splits, t_X, T)

    def combine(self, y_PD, w_NA, info):
        """Weighted sum per received row, the one all-to-all back, sum into token positions."""
        local, in_splits, out_splits, t_X, T = info
        y_ND = self.local.combine(y_PD, w_NA, local)
        back_XD = AllToAll.apply(y_ND, in_splits, out_splits, self.group)
        return back_XD.new_zeros(T, y_PD.shape[1]).index_add(0, t_X, back_XD)
