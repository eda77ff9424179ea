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
               (stable) = the expert-contiguous layout the grouped matmul wants.
    experts    experts(x_PD, counts_E) -- the module call, between the two (a phase of its own).
    combine    weighted sum of a row's pairs on the receiving rank (index_add), then all-to-all
               #4 back in reverse splits, and index_add into the token positions (a token sent
               to two ranks sums two partial mixtures).

Gradients: AllToAll's backward is the reverse all-to-all; everything else (gather, index_add,
masking) is ordinary autograd, so router weights receive their gradient through the sent
weights and the experts' gradients include the tokens of every rank of the group.

`dedup=False` gives the naive path (one row per (token, slot)); it exists for the test that
shows deduplication sends fewer rows and computes the same thing.

Shape legend: T local tokens, A top-k slots, D width, R ep ranks, X sent rows, N received rows,
P received (row, slot) pairs, E local experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pithtrain.models.common import computed_slots


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
    """Same methods as LocalDispatcher: dispatch and combine (each one communication phase of
    common.DecoderLayer.phases) and the call (x_TD, idx_TA, w_TA, experts) -> y_TD doing both
    around the experts. `experts` holds this rank's E/ep experts (its parameters are DTensors sharded by expert; see parallelize.py).
    Counters `rows_sent` / `rows_sent_remote` (rows leaving this rank in total / to other ranks)
    accumulate over calls, for tests and profiling."""

    def __init__(self, group, ep_rank: int, ep_size: int, num_experts: int, dedup: bool = True):
        assert num_experts % ep_size == 0
        self.group, self.ep_rank, self.ep_size = group, ep_rank, ep_size
        self.local_experts = num_experts // ep_size
        self.dedup = dedup
        self.rows_sent = self.rows_sent_remote = 0

    def dispatch(self, x_TD, idx_TA, w_TA, num_experts):
        """-> (x_PD: the received (row, local slot) pairs in expert-contiguous order, w_NA: the
        received rows' weights, counts_E per local expert, info for combine). One communication
        phase: the row counts, then the rows with their weights (differentiable) and their ids."""
        T, A = idx_TA.shape
        R, El = self.ep_size, self.local_experts
        dest_TA = torch.where(computed_slots(idx_TA, R * El), idx_TA // El, R)  # R: to no rank

        # --- send buffer, rank-major: row X goes to rank r_X and carries token t_X
        if self.dedup:
            need_RT = torch.zeros(R + 1, T, dtype=torch.bool, device=x_TD.device)
            need_RT[dest_TA.reshape(-1), torch.arange(T, device=x_TD.device).repeat_interleave(A)] = True
            r_X, t_X = need_RT[:R].nonzero(as_tuple=True)  # sorted by rank, then token
            keep_XA = dest_TA[t_X] == r_X[:, None]  # every slot of the token bound for r_X
        else:
            flat = dest_TA.reshape(-1)
            order_X = torch.argsort(flat, stable=True)[:int((flat < R).sum())]
            r_X, t_X = flat[order_X], order_X // A
            keep_XA = torch.zeros(len(order_X), A, dtype=torch.bool, device=x_TD.device)
            keep_XA[torch.arange(len(order_X), device=x_TD.device), order_X % A] = True
        idx_XA = torch.where(keep_XA, idx_TA[t_X], -1)
        w_XA = torch.where(keep_XA, w_TA[t_X].to(x_TD.dtype), 0)
        send_R = torch.bincount(r_X, minlength=R)
        recv_R = torch.empty_like(send_R)
        dist.all_to_all_single(recv_R, send_R, group=self.group)
        in_splits, out_splits = send_R.tolist(), recv_R.tolist()
        self.rows_sent += len(t_X)
        self.rows_sent_remote += len(t_X) - in_splits[self.ep_rank]

        # --- exchange rows with their weights (one differentiable all-to-all) and expert ids
        D = x_TD.shape[1]
        payload_N = AllToAll.apply(torch.cat([x_TD[t_X], w_XA], dim=1), out_splits, in_splits, self.group)
        x_ND, w_NA = payload_N[:, :D], payload_N[:, D:]
        idx_NA = idx_XA.new_empty((sum(out_splits), A))
        dist.all_to_all_single(idx_NA, idx_XA.contiguous(), out_splits, in_splits, group=self.group)

        # --- expand to (row, local expert) pairs in expert-contiguous order
        local_NA = idx_NA - self.ep_rank * El
        mine_NA = (idx_NA >= 0) & (local_NA >= 0) & (local_NA < El)
        n_P, a_P = mine_NA.nonzero(as_tuple=True)
        e_P = local_NA[n_P, a_P]
        order_P = torch.argsort(e_P, stable=True)
        n_P, a_P, e_P = n_P[order_P], a_P[order_P], e_P[order_P]
        counts_E = torch.bincount(e_P, minlength=El)
        return x_ND[n_P], w_NA, counts_E, (n_P, a_P, in_splits, out_splits, t_X, T)

    def combine(self, y_PD, w_NA, info):
        """Weighted sum per received row, the one all-to-all back, sum into token positions."""
        n_P, a_P, in_splits, out_splits, t_X, T = info
        w_P1 = w_NA[n_P, a_P][:, None].to(y_PD.dtype)  # experts compute in the autocast dtype
        y_ND = y_PD.new_zeros(w_NA.shape[0], y_PD.shape[1]).index_add(0, n_P, y_PD * w_P1)
        back_XD = AllToAll.apply(y_ND, in_splits, out_splits, self.group)
        return back_XD.new_zeros(T, y_PD.shape[1]).index_add(0, t_X, back_XD)

    def __call__(self, x_TD, idx_TA, w_TA, experts):
        x_PD, w_NA, counts_E, info = self.dispatch(x_TD, idx_TA, w_TA, experts.num_experts)
        return self.combine(experts(x_PD, counts_E), w_NA, info)
