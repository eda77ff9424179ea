"""The MoE layer: grouped-matmul path equals the per-expert loop, forward and backward."""

import pytest
import torch

from pithtrain.models.common import GroupedExperts, LocalDispatcher, grouped_mm, grouped_mm_loop
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


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_moe_grouped_equals_loop_forward_backward(top_k):
    torch.manual_seed(1)
    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=48, num_experts=8, top_k=top_k)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(3, 10, 32)
    g = torch.randn(3, 10, 32)

    def run(use_loop):
        moe.zero_grad()
        moe.experts.use_loop = use_loop
        xx = x.clone().requires_grad_()
        y = moe(xx)
        y.backward(g)
        return y.detach(), xx.grad, [p.grad.clone() for p in moe.parameters()]

    y1, gx1, gp1 = run(False)
    y2, gx2, gp2 = run(True)
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(gx1, gx2)
    for a, b in zip(gp1, gp2):
        torch.testing.assert_close(a, b)


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
    y = LocalDispatcher()(x, idx, w, ex)
    ref = torch.zeros(T, D)
    for t in range(T):
        for a in range(A):
            e = idx[t, a]
            gate, up = (x[t] @ ex.w13_EDF2[e]).chunk(2)
            ref[t] += w[t, a] * ((torch.nn.functional.silu(gate) * up) @ ex.w2_EFD[e])
    torch.testing.assert_close(y, ref.detach(), rtol=1e-5, atol=1e-5)


def test_aux_loss_pushes_router_gradient():
    """With aux_loss_coeff > 0 the router receives gradient even when the output grad is zero."""
    torch.manual_seed(3)
    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=32, num_experts=4, top_k=2, aux_loss_coeff=0.1)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    y = moe(torch.randn(2, 8, 32))
    y.backward(torch.zeros_like(y))
    assert moe.gate.weight.grad.abs().sum() > 0
    assert moe.experts.w13_EDF2.grad.abs().sum() == 0
