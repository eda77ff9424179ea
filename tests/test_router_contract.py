"""The router contract (models/common.py, above route_tokens): a slot the FFN experts do not compute
(id DROPPED, or an id past them: a router wider than the FFN experts) is not dispatched, not sent
by the all-to-all and not computed; the load and the metrics are sized by the router's width; and
the experts' `rows_computed` witnesses what was computed (metric `computed_slots_per_token`)."""

import json
import os
import socket

import pytest
import torch
from ranks import spawn
from run_path import dispatched, ep_rank_step
from torch import nn

from pithtrain.distributed.parallel_dims import ParallelDims
from pithtrain.distributed.reductions import balance_after_step
from pithtrain.models import build_model
from pithtrain.models.balance import Balance, reset_step_stats
from pithtrain.models.common import DROPPED, GroupedExperts, LocalDispatcher, computed_slots, dispatch_plan
from pithtrain.models.qwen3_moe import Qwen3MoeConfig

E, D, F, A = 8, 16, 12, 3


def experts(num=E, seed=0):
    torch.manual_seed(seed)
    ex = GroupedExperts(num, D, F)
    torch.nn.init.normal_(ex.w13_EDF2, std=0.3)
    torch.nn.init.normal_(ex.w2_EFD, std=0.3)
    return ex.train()


def routing(T, seed=0, wider=2):
    """Ids of a router `wider` ids wider than the E FFN experts, with a quarter of the slots DROPPED."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E + wider, generator=g)[:A] for _ in range(T)])
    idx[torch.rand(T, A, generator=g) < 0.25] = DROPPED
    idx[0] = DROPPED  # a token with nothing to compute
    return idx, torch.rand(T, A, generator=g)


def dense_reference(x, idx, w, ex):
    """sum over the computed slots of w * expert(x), one token and slot at a time."""
    out = torch.zeros_like(x)
    for t in range(len(x)):
        for a in range(idx.shape[1]):
            e = int(idx[t, a])
            if 0 <= e < ex.num_experts:
                gate, up = (x[t] @ ex.w13_EDF2[e]).chunk(2)
                out[t] = out[t] + w[t, a] * ((nn.functional.silu(gate) * up) @ ex.w2_EFD[e])
    return out


def test_dropped_slots_are_not_dispatched_nor_computed():
    T = 40
    ex = experts()
    x, g = torch.randn(T, D), torch.randn(T, D)
    idx, w = routing(T)
    n = int(computed_slots(idx, E).sum())
    assert 0 < n < T * A and (idx == DROPPED).any() and (idx >= E).any()
    seen = []
    mm = ex.mm
    ex.mm = lambda x_XD, w_EDF, offs_E: seen.append(x_XD.shape[0]) or mm(x_XD, w_EDF, offs_E)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = dispatched(LocalDispatcher(drops=True), xl, idx, wl, ex)
    (y * g).sum().backward()
    assert seen == [n, n] and ex.rows_computed == n  # both GEMMs, and the witness: computed slots only
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = dense_reference(xr, idx, wr, ex)
    (ref * g).sum().backward()
    torch.testing.assert_close(y, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xl.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wl.grad, wr.grad, rtol=1e-5, atol=1e-5)
    assert not wl.grad[~computed_slots(idx, E)].any() and not y[0].any()
    # the fused path's plan: the computed slots first in expert order, the others' place -1
    order_X, counts_E, inv_TA = torch.compile(dispatch_plan, fullgraph=True, backend="eager")(idx, E, True, True)
    keep = computed_slots(idx, E).flatten()
    assert torch.equal(counts_E, torch.bincount(idx.flatten()[keep], minlength=E)[:E])
    assert keep[order_X[:n]].all() and not keep[order_X[n:]].any()
    assert torch.equal(order_X[inv_TA.flatten()[keep]], keep.nonzero().flatten())
    assert (inv_TA.flatten()[~keep] == -1).all()


def test_without_drops_the_dispatcher_refuses_a_dropped_id():
    """LocalDispatcher() keeps its host-synchronisation-free plan: a slot it cannot compute fails
    the per-expert count instead of being computed as something else."""
    idx, w = routing(6)
    with pytest.raises(RuntimeError, match="out of bounds"):
        dispatched(LocalDispatcher(), torch.randn(6, D), idx, w, experts())


def widen_router(moe, width: int, cfg):
    """What a variant with zero-compute experts does: its router scores `width` ids, of which the
    first experts.num_experts are the FFN experts; its balancing unit counts them all."""
    moe.gate = nn.Linear(cfg.hidden_size, width, bias=False)
    torch.nn.init.normal_(moe.gate.weight, std=0.5)
    moe.num_experts = width
    moe.balance = Balance(cfg, width, cfg.top_k)
    moe.balance.reset_parameters()
    moe.dispatcher = LocalDispatcher(drops=True)


@pytest.mark.quick
def test_a_router_wider_than_the_ffn_experts_sizes_load_and_metrics():
    """Router width 12 over 8 FFN experts, balance=bias: training forwards and backwards run
    through the layer's phases, the load has 12 ids, the bias moves for 12, the slots on ids 8..11
    are not computed, and the step's metrics say how many were (the witness)."""
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         moe_intermediate_size=16, num_experts=8, top_k=2, balance="bias", aux_loss_coeff=0.0,
                         bias_update_rate=0.1)
    torch.manual_seed(0)
    model = build_model(cfg).train()
    routed = []

    def recorded(route):
        def call(x_TD):
            out = route(x_TD)
            routed.append(out[-1])
            return out
        return call

    for layer in model.layers:
        widen_router(layer.mlp, 12, cfg)
        layer.mlp.route = recorded(layer.mlp.route)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids, labels_BS=ids).backward()
    computed = sum(int(computed_slots(r, 8).sum()) for r in routed)
    assert all(r.max() >= 8 for r in routed) and computed < 2 * 32 * 2  # some slots went past the experts
    loads = [layer.mlp.balance.stats[:12].clone() for layer in model.layers]
    assert [int(ld[8:].sum()) > 0 for ld in loads] == [True, True]
    m = balance_after_step(model, ParallelDims(), cfg, metrics=True)
    assert m["experts_per_token"] == {"mean": 2.0, "min": 2, "max": 2} and m["dropped_slot_share"] == 0.0
    assert m["computed_slots_per_token"] == pytest.approx(computed / (2 * 32))  # tokens x layers
    for layer, load in zip(model.layers, loads):
        want = 0.1 * torch.sign(load.double().mean() - load.double())
        torch.testing.assert_close(layer.mlp.balance.bias_E, want.float())
    reset_step_stats(model)  # the train step's, after the balancing update
    assert all(layer.mlp.experts.rows_computed == 0 and not layer.mlp.balance.stats.any() for layer in model.layers)


# ---------------------------------------------------------------------------------------------
# Expert parallel: one gloo launch of 2 processes


def _ep_worker(rank: int, world: int, port: int, tmp: str):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    T, El = 24, E // world
    full = experts()  # the same global tokens, routing and experts on every rank
    x, g = torch.randn(world * T, D), torch.randn(world * T, D)
    idx, w = routing(world * T)
    ref = dense_reference(x, idx, w, full)
    mine = slice(rank * T, (rank + 1) * T)
    out = {"pairs": int(sum(((computed_slots(idx[mine], E) & (idx[mine] // El == r)).any(1)).sum()
                             for r in range(world)))}
    y, xl, wl, local, d = ep_rank_step(full, rank, world, x, idx, w, g)
    torch.testing.assert_close(y, ref[mine], rtol=1e-5, atol=1e-5)
    assert not wl.grad[~computed_slots(idx[mine], E)].any()
    out["dedup"] = [d.rows_sent, local.rows_computed]
    with open(os.path.join(tmp, f"ep-{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def test_expert_parallel_sends_and_computes_no_dropped_slot(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn(_ep_worker, args=(2, port, str(tmp_path)), nprocs=2)
    out = [json.loads((tmp_path / f"ep-{r}.json").read_text()) for r in range(2)]
    idx, _ = routing(48)
    n = int(computed_slots(idx, E).sum())
    for r in out:  # one row per (token, rank) with a slot there to compute
        assert r["dedup"][0] == r["pairs"]
    assert sum(r["dedup"][1] for r in out) == n  # computed: once each


@pytest.mark.gpu
def test_fused_permute_skips_dropped_slots():
    """kernels/permute.py with DROPPED slots and ids past the experts against the index / index_add path."""
    from pithtrain.kernels.permute import permute  # noqa: F401 (needs Triton)
    T = 2048
    idx, w = routing(T)
    x, w, idx = torch.randn(T, D, device="cuda"), w.cuda(), idx.cuda()
    outs = []
    for fused in (True, False):
        disp = LocalDispatcher(drops=True)
        disp.fused = fused
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        x_XD, w_d, counts, info = disp.dispatch(xx, idx, ww, E)
        y = disp.combine(x_XD * 1.5, w_d, info)
        y.backward(torch.ones_like(y))
        outs.append((x_XD.shape[0], y, xx.grad, ww.grad))
    (n, y, gx, gw), (n_ref, y_ref, gx_ref, gw_ref) = outs
    assert n == n_ref == int(computed_slots(idx, E).sum())
    for a, b in ((y, y_ref), (gx, gx_ref), (gw, gw_ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# FLOPs and MFU from what the routing computed


def test_flops_take_the_computed_slots_and_stay_static_without_them():
    from pithtrain.metrics import flops_per_token
    from pithtrain.models.gpt_oss import GptOssConfig
    cfg = Qwen3MoeConfig(vocab_size=100, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                         head_dim=4, moe_intermediate_size=6, num_experts=4, top_k=2,
                         intermediate_size=10, mlp_only_layers=[0])
    # tests/test_train.py's hand count: 6 * 1744 + 1536 with 2 experts of 3 * 8 * 6 = 144 in the MoE layer
    assert flops_per_token(cfg, 16) == flops_per_token(cfg, 16, 2.0) == 6 * 1744 + 1536
    assert flops_per_token(cfg, 16, 1.25) == 6 * (1744 - 0.75 * 144) + 1536
    oss = GptOssConfig()  # every layer MoE, experts with biases: one expert is 3 * D * F + 2 * F + D
    expert = 3 * oss.hidden_size * oss.intermediate_size + 2 * oss.intermediate_size + oss.hidden_size
    assert flops_per_token(oss, 32, oss.top_k - 1) == pytest.approx(
        flops_per_token(oss, 32) - 6 * oss.num_layers * expert)


def test_a_run_whose_router_drops_slots_logs_mfu_of_what_was_computed(tmp_path, monkeypatch):
    """Every other token's second slot DROPPED: the step's metrics say 1.5 slots were computed per
    token (the experts' witness), and MFU counts those FLOPs, not top_k's."""
    import pithtrain.build as build_mod
    import pithtrain.train as train_mod
    from pithtrain.config import load_config
    from pithtrain.metrics import flops_per_token
    build = build_mod.build_model

    def dropping(route):
        def call(x_TD):
            logits_TE, probs_TE, w_TA, idx_TA = route(x_TD)
            idx_TA = idx_TA.clone()
            idx_TA[::2, 1] = DROPPED
            return logits_TE, probs_TE, w_TA, idx_TA
        return call

    def build_dropping(*args, **kwargs):  # the trainer's model, its routers dropping
        model = build(*args, **kwargs)
        for layer in model.layers:
            layer.mlp.route, layer.mlp.dispatcher = dropping(layer.mlp.route), LocalDispatcher(drops=True)
        return model

    monkeypatch.setattr(build_mod, "build_model", build_dropping)
    cfg = load_config(None, ["train.steps=2", "train.micro_batch_size=2", "train.seq_len=32", "log.every=1",
                             "model.hidden_size=32", "model.num_layers=2", "data.max_bytes=20000",
                             "log.peak_tflops=1", "checkpoint.final=false", f"log.run_dir={tmp_path}"])
    train_mod.train(cfg, resume=False)
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2
    for r in recs:
        assert r["computed_slots_per_token"] == 1.5 and r["dropped_slot_share"] == 0.25
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops_per_token(cfg.model, 32, 1.5) / 1e12)
        assert flops_per_token(cfg.model, 32, 1.5) < flops_per_token(cfg.model, 32)
