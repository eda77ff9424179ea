"""Numbers that must be global across ranks: the logged loss, the gradient norm used for
clipping, and the expert-load statistics. Each is one small function; with world size 1 they
do the single-process computation and no communication.

Loss normalisation needs no collective: the global batch is a pure function of (seed, step), so
every rank counts the global batch's targets itself (train.py) and divides its local summed loss
by that count; the gradient sum over ranks (FSDP's reduce, a SUM) is then the single-process
gradient.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from pithtrain.models.balance import Balance
from pithtrain.models.common import local


def all_sum(values: list[float], dims) -> list[float]:
    """Sum per-rank numbers over every rank (e.g. each rank's summed token loss and token count)."""
    if not dims.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return t.tolist()


def any_rank(flags: list[int], dims, group=None) -> list[int]:
    """Each flag's maximum over every rank (train.py's step boundary: a notice one rank got, a timed
    save one rank's clock made due), so every rank acts on it at the same step. A CPU tensor over
    `group` (the checkpointer's gloo group): no device synchronisation inside the step."""
    if not dims.distributed:
        return flags
    t = torch.tensor(flags, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _comm_device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"


@torch.no_grad()
def grad_norm(grads, dims) -> float:
    """Global L2 norm of all gradients `grads` (the run's precision.grads: each .grad, or lean's
    float32 buffers; train_step clips by `clip_coef` of it: the multiply is `scale_grads_`, or
    inside the optimizer's own pass where it takes a grad_scale).

    Sharded gradients are DTensors on different meshes (dense on (dp, fsdp_cp), experts on
    (edp, efsdp, ep)), which one torch norm call cannot mix. Each rank sums the squares of its
    local shards, weighting a shard by 1 / (number of ranks holding a copy of it: the sizes of
    the mesh dims where it is Replicate), and one all-reduce over the world (pipeline stages
    hold different parameters, so they sum too) gives the square of the global norm."""
    shards, weight = [], []
    for g in grads:
        w = 1.0
        if isinstance(g, DTensor):
            for size, pl in zip(g.device_mesh.shape, g.placements):
                if isinstance(pl, Replicate):
                    w /= size
            g = g.to_local()
        shards.append(g)
        weight.append(w)
    total = torch.zeros((), dtype=torch.float64, device=shards[0].device if shards else "cpu")
    for dtype in {g.dtype for g in shards}:  # one fused norm kernel per dtype, no gradient-sized temporary
        i = [k for k, g in enumerate(shards) if g.dtype == dtype]
        norms = torch.stack(torch._foreach_norm([shards[k] for k in i])).double()
        total += (norms ** 2 * torch.tensor([weight[k] for k in i], dtype=torch.float64, device=norms.device)).sum()
    if dims.distributed:
        total = total.to(_comm_device())
        dist.all_reduce(total)
    return math.sqrt(float(total))  # the host waits here for the backward: one synchronisation per step


def clip_coef(norm: float, max_norm: float) -> float:
    """The rule of torch.nn.utils.clip_grad_norm_: scale by min(1, max_norm / (norm + 1e-6));
    max_norm 0 turns clipping off."""
    return min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0


def scale_grads_(params, coef: float) -> None:
    if coef != 1.0:
        torch._foreach_mul_([local(p.grad) for p in params if p.grad is not None], coef)


@torch.no_grad()
def balance_after_step(model: torch.nn.Module, dims, model_cfg, metrics: bool) -> dict:
    """After the optimizer step (every rank calls it: collective when distributed). Each MoE
    block's step statistics (models/balance.py `Balance.stats`: kept slots per id, then tokens
    per number of kept slots, over this rank's micro-batches; and its experts' `rows_computed`)
    are summed over the ranks holding the same layers (the stage group: other tokens, same
    experts); each unit updates from the global load (balance=bias moves its bias, identically on
    every rank). The sum is skipped when nothing needs it (no bias to move and no metrics this
    step). The statistics are read, not reset: the train step restarts them
    (balance.reset_step_stats). The load's width is the routers' (`Balance.num_experts`, which
    may exceed the FFN experts), not the config's num_experts.

    With metrics=True, returns the routing metrics of the step's global batch (routing_metrics)."""
    blocks = [(int(name.split(".")[1]), m) for name, m in model.named_modules()
              if isinstance(getattr(m, "balance", None), Balance)]
    if not metrics and all(m.balance.bias_E is None for _, m in blocks):
        return {}
    device = _comm_device() if dims.distributed else "cpu"
    E, A = (max((getattr(m.balance, k) for _, m in blocks), default=0) for k in ("num_experts", "top_k"))
    if metrics and dims.pp_enabled:  # every stage's table has every layer: a stage may hold no MoE layer
        widths = torch.tensor([E, A], device=device)
        dist.all_reduce(widths, op=dist.ReduceOp.MAX)
        E, A = widths.tolist()
    # One row per layer (E + A + 1 statistics, the rows the experts computed, then 1.0 for "a MoE
    # layer"); pipeline stages hold different layers, so rows this rank does not hold stay zero.
    table = torch.zeros(model_cfg.num_layers, E + A + 3, dtype=torch.float64, device=device)
    for i, m in blocks:
        table[i, :-2] = m.balance.stats.to(table.device, torch.float64)
        table[i, -2:] = torch.tensor([m.experts.rows_computed, 1.0])
    if dims.distributed:  # a layer's rows of every rank holding it: the same layers, other tokens;
        # for metrics every layer, on every rank (the other stages' rows are zero here)
        dist.all_reduce(table, group=None if metrics else dims.stage_group)
    for i, m in blocks:
        m.balance.update(table[i, :E])
    return routing_metrics(table.cpu(), E) if metrics else {}


def routing_metrics(table: torch.Tensor, num_experts: int) -> dict:
    """From (layers, E + A + 3) global step statistics: per MoE layer (keyed by layer index) the
    expert load's max / mean and coefficient of variation (std / mean); the worst layer's max /
    mean as `imbalance` (1.0 = balanced); over every MoE layer and token, the slots a token kept
    (`experts_per_token` mean, min, max), the share of its A slots the router dropped
    (`dropped_slot_share`: id common.DROPPED) and the slots its FFN experts computed
    (`computed_slots_per_token`, from GroupedExperts.rows_computed: the witness that dropped slots,
    and ids past the FFN experts, were not computed; MFU's routed-expert FLOPs, metrics.flops_per_token)."""
    out = {"load_max_mean": {}, "load_cv": {}, "imbalance": 1.0}
    moe = table[table[:, -1] > 0]
    rows = [i for i in range(len(table)) if table[i, -1] > 0]
    for i, row in zip(rows, moe):
        load = row[:num_experts]
        mean = load.mean().clamp(min=1e-9)
        out["load_max_mean"][str(i)] = float(load.max() / mean)
        out["load_cv"][str(i)] = float(load.std(unbiased=False) / mean)
    if rows:
        out["imbalance"] = max(out["load_max_mean"].values())
        hist = moe[:, num_experts:-2].sum(0)  # tokens that kept 0, 1, ..., A slots
        kept = torch.arange(len(hist), dtype=torch.float64)
        if hist.sum() > 0:
            used = kept[hist > 0]
            out["experts_per_token"] = {"mean": float((hist * kept).sum() / hist.sum()),
                                        "min": int(used.min()), "max": int(used.max())}
            out["dropped_slot_share"] = float(1 - (hist * kept).sum() / (hist.sum() * kept[-1]))
            out["computed_slots_per_token"] = float(moe[:, -2].sum() / hist.sum())
    return out
