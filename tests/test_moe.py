"""The MoE layer: grouped-matmul path equals the per-expert loop, forward and backward."""

import pytest
import torch
from run_path import dispatched

from pithtrain.models.common import (
    GroupedExperts,
    LocalDispatcher,
    expert_order,
    grouped_mm,
    grouped_mm_loop,
    mlp_output,
    set_aux_loss_scale,
)
from pithtrain.models.qwen3_moe import MoE, Qwen3MoeConfig


def test_grouped_mm_matches_loop_including_empty_experts():
    torch.manual_seed(0)
    x = torch.randn(20, 16, requires_grad=True)
    w = torch.randn(4, 16, 32, requires_grad=True)
    offs = torch.tensor([5, 5, 12, 20])  # expert 1 gets no rows
    g = torch.randn(20, 32)
    y = grouped_mm(x, w, offs)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    y_ref = grouped_mm_loop(x, w, offs)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, w), g)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(gx, gx_ref)
    torch.testing.assert_close(gw, gw_ref)
    assert gw[1].abs().sum() == 0


@pytest.mark.quick
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_moe_grouped_equals_loop_forward_backward(top_k):
    torch.manual_seed(1)
    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=48, num_experts=8, top_k=top_k)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(3, 10, 32)
    g = torch.randn(3, 10, 32)

    def run(mm):
        moe.zero_grad()
        moe.experts.mm = mm
        xx = x.clone().requires_grad_()
        y = mlp_output(moe, xx)
        y.backward(g)
        return y.detach(), xx.grad, [p.grad.clone() for p in moe.parameters()]

    y1, gx1, gp1 = run(grouped_mm)
    y2, gx2, gp2 = run(grouped_mm_loop)
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(gx1, gx2)
    for a, b in zip(gp1, gp2):
        torch.testing.assert_close(a, b)


@pytest.mark.quick
def test_dispatch_matches_dense_mixture():
    """Permute -> experts -> weighted combine equals sum_k w_k * expert_{idx_k}(x) per token."""
    torch.manual_seed(2)
    E, D, F, T, A = 4, 16, 24, 12, 2
    ex = GroupedExperts(E, D, F)
    torch.nn.init.normal_(ex.w13_EDF2, std=0.3)
    torch.nn.init.normal_(ex.w2_EFD, std=0.3)
    x = torch.randn(T, D)
    idx = torch.stack([torch.randperm(E)[:A] for _ in range(T)])
    w = torch.rand(T, A)
    y = dispatched(LocalDispatcher(), x, idx, w, ex)
    ref = torch.zeros(T, D)
    for t in range(T):
        for a in range(A):
            e = idx[t, a]
            gate, up = (x[t] @ ex.w13_EDF2[e]).chunk(2)
            ref[t] += w[t, a] * ((torch.nn.functional.silu(gate) * up) @ ex.w2_EFD[e])
    torch.testing.assert_close(y, ref.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("balance", ["switch", "sequence"])
@pytest.mark.parametrize("micro_batches", [1, 4])
def test_aux_loss_router_gradient_is_the_hand_written_loss_gradient(balance, micro_batches):
    """With a zero output gradient only the balancing loss reaches the router: its gradient is
    that of scale * coeff * E * sum_e f_e * P_e written out here (f_e the share of the T * A routed
    slots sent to expert e, P_e the mean router probability of e; per sequence and averaged over
    the B sequences for `sequence`), with scale = 1 / micro-batches as the trainer sets it
    (set_aux_loss_scale). The experts get nothing."""
    torch.manual_seed(3)
    B, S, D, E, A, coeff = 2, 8, 32, 4, 2, 0.1
    cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=32, num_experts=E, top_k=A, aux_loss_coeff=coeff,
                         balance=balance)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    set_aux_loss_scale(moe, 1.0 / micro_batches)
    x = torch.randn(B, S, D)
    y = mlp_output(moe, x)
    y.backward(torch.zeros_like(y))

    w = moe.gate.weight.detach().clone().requires_grad_()
    probs_BSE = torch.softmax(x @ w.T, dim=-1)
    idx_BSA = probs_BSE.topk(A, dim=-1).indices
    if balance == "switch":  # the micro-batch is one group
        probs_BSE, idx_BSA = probs_BSE.reshape(1, B * S, E), idx_BSA.reshape(1, B * S, A)
    f_BE = torch.stack([torch.bincount(i.flatten(), minlength=E) for i in idx_BSA]) / (idx_BSA.shape[1] * A)
    P_BE = probs_BSE.mean(1)
    loss = coeff * E * (f_BE * P_BE).sum(1).mean() / micro_batches
    (ref,) = torch.autograd.grad(loss, w)
    assert ref.abs().sum() > 0
    torch.testing.assert_close(moe.gate.weight.grad, ref)
    assert moe.experts.w13_EDF2.grad.abs().sum() == 0 and moe.experts.w2_EFD.grad.abs().sum() == 0


@pytest.mark.quick
@pytest.mark.parametrize("fp8_on", [False, True])
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_experts_compute_in_the_autocast_dtype_locally_and_behind_expert_parallel(fp8_on, tmp_path):
    """Float32 master weights and residual stream under bf16 autocast (train.py on a GPU): the
    experts take bf16 operands like every nn.Linear, so the FP8 path's bf16 weight grad and
    saved activations hold, and the expert-parallel combine adds bf16 rows (it mixed dtypes)."""
    import torch.distributed as dist

    from pithtrain.distributed.expert_parallel import ExpertParallelDispatcher
    from pithtrain.kernels.fp8_linear import FP8GroupedMM
    torch.manual_seed(3)
    experts = GroupedExperts(8, 128, 128)
    if fp8_on:  # CPU tensors: fp8_linear's PyTorch reference
        experts.mm = FP8GroupedMM()
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(24, 128)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(24)])
    w = torch.softmax(torch.randn(24, 2), dim=-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x_XD, _, counts, _ = LocalDispatcher().dispatch(x, idx, w, 8)
        assert experts(x_XD, counts).dtype == torch.bfloat16
        y_local = dispatched(LocalDispatcher(), x, idx, w, experts)
    # the same as handing the experts bf16 rows outside autocast (weights cast, or quantised, alike)
    torch.testing.assert_close(y_local, dispatched(LocalDispatcher(), x.bfloat16(), idx, w.bfloat16(), experts),
                               rtol=0, atol=0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y_ep = dispatched(ExpertParallelDispatcher(dist.group.WORLD, 0, 1, 8), x, idx, w, experts)
    finally:
        dist.destroy_process_group()
    assert y_ep.dtype == torch.bfloat16
    torch.testing.assert_close(y_ep, y_local, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("E", [8, 256, 300])
def test_expert_order_is_the_stable_argsort_of_the_expert_ids(E):
    """One-byte keys up to 256 experts (one radix pass on the GPU), the ids themselves beyond."""
    idx = torch.randint(0, E, (2048,))
    assert torch.equal(expert_order(idx, E), torch.argsort(idx, stable=True))


@pytest.mark.quick
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "gpt_oss"])
def test_a_change_to_a_family_block_reaches_the_training_step(family, monkeypatch):
    """A MoE block has no forward of its own: the training step (build.build_run + train.train_step,
    what train.py and the bench run) calls every method the family's MoE and attention classes
    define, and a change to the router changes the step's loss. A variant written into a method the
    step never calls (a `forward` beside the layer's phases, say) fails here, naming it."""
    import importlib
    import inspect

    from test_distributed import FAMILIES

    from pithtrain.build import build_run
    from pithtrain.config import config_from_dict
    from pithtrain.distributed.parallel_dims import ParallelDims
    from pithtrain.train import train_step

    module = importlib.import_module(f"pithtrain.models.{family}")
    called, halve = set(), [False]
    for cls in (module.MoE, module.Attention):
        for name, fn in list(vars(cls).items()):
            if inspect.isfunction(fn) and not name.startswith("__"):
                def spy(*args, _fn=fn, _name=f"{cls.__name__}.{name}", **kwargs):
                    called.add(_name)
                    out = _fn(*args, **kwargs)
                    if _name == "MoE.route" and halve[0]:  # a variant's change to the router's weights
                        out = (*out[:2], out[2] * 0.5, out[3])
                    return out
                monkeypatch.setattr(cls, name, spy)
    defined = {f"{c.__name__}.{n}" for c in (module.MoE, module.Attention) for n, f in vars(c).items()
               if inspect.isfunction(f) and not n.startswith("__")}
    assert "MoE.route" in defined and "MoE.forward" not in defined
    cfg = config_from_dict({"model": FAMILIES[family], "train": dict(micro_batch_size=2, seq_len=16, grad_accum=2),
                            "checkpoint": dict(final=False)})
    x = torch.randint(0, cfg.model.vocab_size, (2, 2, 17), generator=torch.Generator().manual_seed(0))
    mbs = [(b[:, :-1], b[:, 1:], None, None) for b in x]
    losses = []
    for halve[0] in (False, True):
        torch.manual_seed(cfg.train.seed)
        run = build_run(cfg, torch.device("cpu"), ParallelDims.from_config(cfg, 1, 0))
        losses.append(train_step(run, mbs, 2 * 2 * 16).loss)
    assert called == defined, f"never called by the training step: {sorted(defined - called)}"
    assert losses[0] != losses[1], losses
