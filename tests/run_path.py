"""What tests call the way a run calls it: the dispatch -> experts -> combine part of a MoE block's
phases (models.common.mlp_phases, the code a layer runs in training), for tests that hand a
dispatcher its routing directly; and the kernel choice of a run on one GPU (kernels.configure
takes every fact of the run, with no default)."""

from types import SimpleNamespace

from pithtrain import kernels
from pithtrain.models.common import mlp_phases, run_phases


def dispatched(dispatcher, x_TD, idx_TA, w_TA, experts):
    """y (T, D): the rows of x sent by `dispatcher` to `experts` and combined with the weights w,
    through the block phases dispatch, experts and combine."""
    block = SimpleNamespace(dispatcher=dispatcher, experts=experts)
    phases = [ph for ph in mlp_phases(block) if ph.name in ("dispatch", "experts", "combine")]
    return run_phases(phases, {"x": x_TD[None], "idx": idx_TA, "w": w_TA})["y"]


def one_gpu_kernels(mode: str, device, **facts) -> dict:
    """kernels.configure for a run on one GPU (bf16 compute, no FSDP, no context parallel, no
    FP8) unless `facts` say otherwise."""
    return kernels.configure(mode, device, **{"fp8": False, "bf16": True, "fsdp": False, "experts_alone": False,
                                              "cp": False, **facts})
