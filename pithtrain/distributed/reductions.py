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


def all_sum(values: list[float], dims) -> list[float]:
    """Sum per-rank numbers over every rank (e.g. each rank's summed token loss and token count)."""
    if not dims.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return t.tolist()


def _comm_device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, dims) -> float:
    """Global L2 norm of all gradients, then scale them by min(1, max_norm / (norm + 1e-6)) (the
    rule of torch.nn.utils.clip_grad_norm_). Returns the norm before clipping.

    Sharded gradients are DTensors on different meshes (dense on (dp, fsdp_cp), experts on
    (edp, efsdp, ep)), which one torch norm call cannot mix. Each rank sums the squares of its
    local shards, weighting a shard by 1 / (number of ranks holding a copy of it: the sizes of
    the mesh dims where it is Replicate), and one all-reduce over the world (pipeline stages
    hold different parameters, so they sum too) gives the square of the global norm."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.zeros((), dtype=torch.float64, device=_grad_device(grads))
    for g in grads:
        weight = 1.0
        if isinstance(g, DTensor):
            for size, pl in zip(g.device_mesh.shape, g.placements):
                if isinstance(pl, Replicate):
                    weight /= size
            g = g.to_local()
        total += weight * torch.linalg.vector_norm(g).double() ** 2  # no gradient-sized temporary
    if dims.distributed:
        total = total.to(_comm_device())
        dist.all_reduce(total)
    norm = math.sqrt(float(total))
    if max_norm > 0:
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return norm


def _grad_device(grads):
    if not grads:
        return "cpu"
    g = grads[0]
    return (g.to_local() if isinstance(g, DTensor) else g).device


def expert_imbalance(model: torch.nn.Module, dims) -> float:
    """max / mean tokens per expert of the last forward, worst MoE layer, over the tokens of
    every rank (collective when distributed: every rank calls it). 1.0 = balanced."""
    counts = [m.last_counts_E for m in model.modules() if getattr(m, "last_counts_E", None) is not None]
    if dims.distributed and counts:
        stacked = torch.stack([c.to(_comm_device(), torch.float64) for c in counts])
        dist.all_reduce(stacked, group=dims.stage_group)  # the same layers, other tokens
        counts = list(stacked)
    worst = 1.0
    for c in counts:
        c = c.double()
        worst = max(worst, float(c.max() / c.mean().clamp(min=1e-9)))
    if dims.distributed:
        t = torch.tensor([worst], dtype=torch.float64, device=_comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the worst layer of every pipeline stage
        worst = float(t.item())
    return worst
