"""The dispatch -> experts -> combine part of a MoE block's phases (models.common.mlp_phases: the
code a layer runs in training), for tests that hand a dispatcher its routing directly."""

from types import SimpleNamespace

from pithtrain.models.common import mlp_phases, run_phases


def dispatched(dispatcher, x_TD, idx_TA, w_TA, experts):
    """y (T, D): the rows of x sent by `dispatcher` to `experts` and combined with the weights w,
    through the block phases dispatch, experts and combine."""
    block = SimpleNamespace(dispatcher=dispatcher, experts=experts)
    phases = [ph for ph in mlp_phases(block) if ph.name in ("dispatch", "experts", "combine")]
    return run_phases(phases, {"x": x_TD[None], "idx": idx_TA, "w": w_TA})["y"]
