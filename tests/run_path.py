"""What tests call the way a run calls it: the dispatch -> experts -> combine part of a MoE block's
phases (models.common.mlp_phases, the code a layer runs in training), for tests that hand a
dispatcher its routing directly; and the kernel choice of a run on one GPU (kernels.configure
takes every fact of the run, with no default)."""

from types import SimpleNamespace

import torch

from pithtrain import kernels
from pithtrain.models.common import mlp_phases, run_phases


def dispatched(dispatcher, x_TD, idx_TA, w_TA, experts):
    """y (T, D): the rows of x sent by `dispatcher` to `experts` and combined with the weights w,
    through the block phases dispatch, experts and combine."""
    block = SimpleNamespace(dispatcher=dispatcher, experts=experts)
    phases = [ph for ph in mlp_phases(block) if ph.name in ("dispatch", "experts", "combine")]
    return run_phases(phases, {"x": x_TD[None], "idx": idx_TA, "w": w_TA})["y"]


def ep_rank_step(full, rank: int, world: int, x_TD, idx_TA, w_TA, g_TD):
    """This rank's slice of the tokens through its own experts (`full`'s E / world) behind the
    expert-parallel dispatcher, forward and backward against g: (y, x, w with their gradients,
    the rank's experts, the dispatcher)."""
    import torch.distributed as dist

    from pithtrain.distributed.expert_parallel import ExpertParallelDispatcher
    from pithtrain.models.common import GroupedExperts
    E, T = full.w13_EDF2.shape[0], x_TD.shape[0] // world
    El, mine = E // world, slice(rank * T, (rank + 1) * T)
    local = GroupedExperts(El, full.w13_EDF2.shape[1], full.w2_EFD.shape[1])  # training mode
    with torch.no_grad():
        local.w13_EDF2.copy_(full.w13_EDF2[rank * El:(rank + 1) * El])
        local.w2_EFD.copy_(full.w2_EFD[rank * El:(rank + 1) * El])
    d = ExpertParallelDispatcher(dist.group.WORLD, rank, world, E)
    xl, wl = x_TD[mine].clone().requires_grad_(), w_TA[mine].clone().requires_grad_()
    y = dispatched(d, xl, idx_TA[mine], wl, local)
    (y * g_TD[mine]).sum().backward()
    return y, xl, wl, local, d


def one_gpu_kernels(mode: str, device, **facts) -> dict:
    """kernels.configure for a run on one GPU (bf16 compute, no FSDP, no context parallel, no
    FP8) unless `facts` say otherwise."""
    return kernels.configure(mode, device, **{"fp8": False, "bf16": True, "fsdp": False, "experts_alone": False,
                                              "cp": False, **facts})
