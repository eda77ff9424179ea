"""Load balancing (pithtrain/models/balance.py), each strategy against a reference no one here wrote:

    switch     transformers' Qwen3-MoE `load_balancing_loss_func` (Switch Transformer's loss)
    sequence   the DeepSeek-V2 paper's expert-level balance loss, per sequence (transformers 5.17's
               DeepseekV2 has no auxiliary loss: it is computed here from the paper's formula, in
               loops, and added to transformers' DeepseekV2 loss for the gradient parity)
    z-loss     ST-MoE's router z-loss, (1/T) sum_t (log sum_e exp x_te)^2, written out here
    bias       DeepSeek-V3's update rule (sign and size), the top-k choice on biased scores with
               unbiased weights, identical on every rank (gloo), bit-exact resume, and a run with
               a skewed router whose load it evens out where `none` does not.
Also: counting is right under activation recomputation and over micro-batches, and config errors.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from ranks import spawn  # noqa: E402

from pithtrain.checkpoint import load_hf, save_hf  # noqa: E402
from pithtrain.compile import apply_activation_checkpoint  # noqa: E402
from pithtrain.config import ConfigError, config_from_dict, load_config  # noqa: E402
from pithtrain.distributed.parallel_dims import ParallelDims  # noqa: E402
from pithtrain.distributed.reductions import balance_after_step  # noqa: E402
from pithtrain.models import build_model  # noqa: E402
from pithtrain.models.balance import Balance, BalanceConfig, reset_step_stats  # noqa: E402
from pithtrain.models.common import set_aux_loss_scale  # noqa: E402

ONE = ParallelDims()  # one process: no collectives


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


# ---------------------------------------------------------------------------------------------
# The losses against their references


def test_switch_loss_equals_transformers_qwen3_formula():
    """transformers' f_e counts tokens per expert (sum A over experts), ours slots (sum 1): ours
    is theirs / A, so both are 1 when balanced."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    E, A, T = 8, 2, 96
    torch.manual_seed(0)
    logits = torch.randn(T, E) * 2
    probs = logits.softmax(-1)
    idx = probs.topk(A, dim=-1).indices
    unit = Balance(BalanceConfig(balance="switch", aux_loss_coeff=1.0), E, A)
    ref = load_balancing_loss_func((logits,), E, A) / A
    assert abs(unit.loss(logits, probs, idx).item() - ref.item()) < 1e-6 * ref.item()


def paper_sequence_loss(probs_BSE, idx_BSA):
    """DeepSeek-V2 (arXiv 2405.04434), eq. 23-25, per sequence of S tokens, averaged over the B
    sequences: sum_i f_i P_i, f_i = E / (K S) * #{t : token t selects i}, P_i = (1/S) sum_t s_i,t."""
    B, S, E = probs_BSE.shape
    K = idx_BSA.shape[-1]
    total = 0.0
    for b in range(B):
        chosen = [set(idx_BSA[b, t].tolist()) for t in range(S)]
        for i in range(E):
            f = E / (K * S) * sum(i in c for c in chosen)
            total = total + f * probs_BSE[b, :, i].sum() / S
    return total / B


def test_sequence_loss_equals_the_paper_formula_and_differs_from_switch():
    E, A, B, S = 8, 2, 3, 20
    torch.manual_seed(1)
    # each sequence prefers other experts: balanced over the batch, not within a sequence
    logits = torch.randn(B, S, E) + 3 * torch.eye(E)[[0, 3, 6]][:, None, :]
    probs = logits.softmax(-1)
    idx = probs.topk(A, dim=-1).indices
    seq = Balance(BalanceConfig(balance="sequence", aux_loss_coeff=1.0), E, A)
    ours = seq.loss(logits.flatten(0, 1), probs.flatten(0, 1), idx.flatten(0, 1), sequences=B)
    ref = paper_sequence_loss(probs, idx)
    assert abs(ours.item() - ref.item()) < 1e-6 * ref.item()
    switch = Balance(BalanceConfig(balance="switch", aux_loss_coeff=1.0), E, A)
    assert switch.loss(logits.flatten(0, 1), probs.flatten(0, 1), idx.flatten(0, 1)) < 0.8 * ours
    with pytest.raises(ValueError, match="balance=sequence needs the number of sequences"):
        seq.loss(logits.flatten(0, 1), probs.flatten(0, 1), idx.flatten(0, 1))


DS = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
          num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8,
          v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
          moe_intermediate_size=16, first_k_dense_replace=1, max_position_embeddings=256)


@pytest.mark.parametrize("z", [0.0, 0.05])
def test_deepseek_sequence_loss_gradients_match_transformers_plus_the_paper_loss(tmp_path, z):
    """Our DeepSeek-V2 with balance=sequence (and z-loss) against transformers' DeepseekV2 whose
    loss gets coeff * the paper's sequence loss (+ z * ST-MoE's z-loss) of its own router outputs
    for every MoE layer: every parameter's gradient agrees."""
    torch.manual_seed(0)
    ref = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**DS)).float()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in n else p.normal_(0, 0.15)
    ref.save_pretrained(tmp_path / "hf")
    coeff = 0.3
    ours = load_hf(tmp_path / "hf", balance="sequence", aux_loss_coeff=coeff, z_loss_coeff=z)
    routed = []
    for layer in ref.model.layers[1:]:
        layer.mlp.gate.register_forward_hook(lambda m, i, out: routed.append(out))
    ours.train(), ref.train()
    B, S = 3, 16
    torch.manual_seed(1)
    ids, labels = torch.randint(0, 96, (B, S)), torch.randint(0, 96, (B, S))
    set_aux_loss_scale(ours, 1.0)  # the trainer's 1 / micro-batches; here one micro-batch
    ours(ids, labels_BS=labels).backward()
    loss_r = F.cross_entropy(ref(ids).logits.flatten(0, 1), labels.flatten(), reduction="sum")
    assert len(routed) == 2
    for logits_TE, _, idx_TA in routed:
        loss_r = loss_r + coeff * paper_sequence_loss(logits_TE.softmax(-1).view(B, S, -1), idx_TA.view(B, S, -1))
        loss_r = loss_r + z * torch.log(torch.exp(logits_TE).sum(-1)).pow(2).mean()
    loss_r.backward()
    ref_grads = dict(ref.named_parameters())
    for i in (1, 2):
        g_ours = ours.layers[i].mlp.gate.weight.grad
        g_ref = ref_grads[f"model.layers.{i}.mlp.gate.weight"].grad
        assert rel(g_ours, g_ref) < 1e-5, i
    assert rel(ours.layers[1].self_attn.o_proj.weight.grad,
               ref_grads["model.layers.1.self_attn.o_proj.weight"].grad) < 1e-5


def test_each_model_scales_its_own_balancing_gradient():
    """The aux-loss scale lives on each MoE block: models with scales 0, 1 and 3, run interleaved
    in one process, give router gradients linear in their own scale (g3 - g1 = 2 (g1 - g0))."""
    cfg = load_config(None, ["model.num_layers=2", "model.aux_loss_coeff=0.5"])
    ids = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    models = []
    for scale in (0.0, 1.0, 3.0):
        torch.manual_seed(0)
        models.append(build_model(cfg.model))
        set_aux_loss_scale(models[-1], scale)
    for m in models:
        m(ids[:, :-1], labels_BS=ids[:, 1:]).backward()
    g0, g1, g3 = (m.layers[0].mlp.gate.weight.grad for m in models)
    assert rel(g1, g0) > 1e-3  # the balancing gradient is there at all
    assert rel(g3 - g1, 2 * (g1 - g0)) < 1e-4


# ---------------------------------------------------------------------------------------------
# The bias: choice, update, counting


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "gpt_oss"])
def test_bias_changes_the_choice_not_the_weights(family):
    from pithtrain.models import FAMILIES
    extra = {"norm_topk_prob": False} if family == "qwen3_moe" else {}
    if family == "deepseek_v2":
        extra = {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}
    cfg = FAMILIES[family].config(hidden_size=32, num_experts=8, top_k=2, balance="bias", **extra)
    moe = build_model(cfg).layers[-1].mlp
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    logits, probs, w0, idx0 = moe.route(x)
    assert not (idx0 == 5).any(dim=1).all()  # unbiased, expert 5 is not everyone's choice
    moe.balance.bias_E[5] = 10.0
    logits, probs, w, idx = moe.route(x)
    assert (idx == 5).any(dim=1).all()  # biased, it is
    slot = (idx == 5).long().argmax(1)
    got = w.gather(1, slot[:, None])[:, 0]
    if family == "gpt_oss":  # softmax over the chosen logits: the unbiased ones
        want = logits.gather(1, idx).softmax(-1).gather(1, slot[:, None])[:, 0]
    else:
        want = probs[:, 5] * getattr(moe, "routed_scaling_factor", 1.0)
    torch.testing.assert_close(got, want.to(got.dtype))


@pytest.mark.quick
def test_bias_update_sign_and_size():
    unit = Balance(BalanceConfig(balance="bias", bias_update_rate=0.01), 4, 2)
    unit.reset_parameters()
    unit.update(torch.tensor([10, 2, 6, 6]))  # mean 6: expert 0 over, 1 under, 2 and 3 at the mean
    torch.testing.assert_close(unit.bias_E, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    unit.update(torch.tensor([10, 2, 7, 5]))
    torch.testing.assert_close(unit.bias_E, torch.tensor([-0.02, 0.02, -0.01, 0.01]))
    # through the trainer's calls: the step's statistics are the load, then the step restarts them
    model = build_model(tiny_qwen(num_layers=1, balance="bias", bias_update_rate=0.5, num_experts=4))
    unit = model.layers[0].mlp.balance
    unit.stats[:4] = torch.tensor([1, 3, 2, 2])
    balance_after_step(model, ONE, model.cfg, metrics=False)
    torch.testing.assert_close(unit.bias_E, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    reset_step_stats(model)
    assert not unit.stats.any()


@pytest.mark.parametrize("balance", ["switch", "sequence"])
def test_dropped_slots_count_neither_in_the_load_nor_in_the_loss(balance):
    """A DROPPED slot (id -1, models/common.py's router contract) is no expert's: the load and the
    loss's f_e count kept slots only, written out here in loops (f_e over the group's T * A slots)."""
    E, A, B, S = 6, 2, 2, 10
    torch.manual_seed(3)
    logits = torch.randn(B * S, E)
    probs = logits.softmax(-1)
    idx = probs.topk(A, dim=-1).indices
    idx[torch.rand(B * S, A) < 0.3] = -1
    unit = Balance(BalanceConfig(balance=balance, aux_loss_coeff=1.0), E, A)
    unit.reset_parameters()
    unit.count(idx)
    groups = B if balance == "sequence" else 1
    want = 0.0
    for b in range(groups):
        rows = range(b * S * B // groups, (b + 1) * S * B // groups)
        for e in range(E):
            f = sum(int(idx[t, a]) == e for t in rows for a in range(A)) / (len(rows) * A)
            want += E * f * sum(probs[t, e].item() for t in rows) / len(rows) / groups
    assert unit.loss(logits, probs, idx, sequences=B).item() == pytest.approx(want, rel=1e-6)
    kept = (idx >= 0).sum(1)
    assert unit.stats[:E].tolist() == [int((idx == e).sum()) for e in range(E)]
    assert unit.stats[E:].tolist() == [int((kept == k).sum()) for k in range(A + 1)]


def tiny_qwen(**kw):
    from pithtrain.models.qwen3_moe import Qwen3MoeConfig
    return Qwen3MoeConfig(**{**dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                    head_dim=8, moe_intermediate_size=16, num_experts=8, top_k=2), **kw})


@pytest.mark.parametrize("mode", ["full", "selective", "cheap"])
def test_counts_once_per_micro_batch_under_activation_recompute(mode):
    """Two micro-batches forward + backward: the step's load is the sum of both micro-batches'
    routing (not the last one's), and recomputing the forward in backward adds nothing."""
    torch.manual_seed(0)
    plain = build_model(tiny_qwen())
    recomputed = build_model(tiny_qwen())
    recomputed.load_state_dict(plain.state_dict())
    apply_activation_checkpoint(recomputed, mode)
    seen = {i: torch.zeros(8, dtype=torch.long) for i in range(2)}
    for i, layer in enumerate(plain.layers):  # what each routing call chose, counted here
        route = layer.mlp.route
        layer.mlp.route = lambda x, route=route, i=i: _seen(route(x), seen[i])
    for model in (plain, recomputed):
        model.train()
        for micro in range(2):
            ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(micro))
            model(ids, labels_BS=ids).backward()
    for i in range(2):
        stats_plain = plain.layers[i].mlp.balance.stats
        assert torch.equal(stats_plain[:8], seen[i])
        assert stats_plain[:8].sum() == 2 * 2 * 12 * 2  # micro-batches x tokens x slots
        assert stats_plain[8:].tolist() == [0, 0, 2 * 2 * 12]  # every token kept its 2 slots
        assert torch.equal(recomputed.layers[i].mlp.balance.stats, stats_plain)


def _seen(routed, counts):
    counts += torch.bincount(routed[-1].flatten(), minlength=len(counts))
    return routed


@pytest.mark.quick
def test_routing_metrics_per_layer_and_dropped_slots():
    """Per-layer max/mean and CV, experts per token and the dropped share, from known counts."""
    model = build_model(tiny_qwen(num_layers=3, mlp_only_layers=[0]))
    a, b = model.layers[1].mlp.balance, model.layers[2].mlp.balance
    a.stats[:8] = torch.tensor([4, 4, 4, 4, 4, 4, 4, 4])
    a.stats[8:] = torch.tensor([0, 0, 16])
    b.stats[:8] = torch.tensor([12, 4, 4, 4, 0, 0, 0, 0])
    b.stats[8:] = torch.tensor([2, 4, 10])  # 2 tokens dropped both slots, 4 one
    m = balance_after_step(model, ONE, model.cfg, metrics=True)
    assert m["load_max_mean"] == {"1": 1.0, "2": 12 / 3}
    assert m["load_cv"]["1"] == 0.0 and m["load_cv"]["2"] == pytest.approx(torch.tensor(
        [12, 4, 4, 4, 0, 0, 0, 0.]).std(unbiased=False).item() / 3)
    assert m["imbalance"] == 4.0
    assert m["experts_per_token"] == {"mean": (16 * 2 + 4 + 20) / 32, "min": 0, "max": 2}
    assert m["dropped_slot_share"] == pytest.approx(1 - (16 * 2 + 4 + 20) / 64)


# ---------------------------------------------------------------------------------------------
# Config


def test_config_choices_and_errors():
    # default.yaml's aux_loss_coeff is the default (0.01): switching to bias from the command line needs nothing else
    cfg = load_config(None, ["model.balance=bias", "model.bias_update_rate=0.01", "model.z_loss_coeff=1e-3"])
    assert (cfg.model.balance, cfg.model.bias_update_rate, cfg.model.z_loss_coeff) == ("bias", 0.01, 1e-3)
    for bad, msg in ((["model.balance=aux"], "model.balance: expected one of"),
                     (["model.balance=bias", "model.aux_loss_coeff=0.001"],
                      "model.aux_loss_coeff: does not apply to balance=bias \\(only to switch and sequence\\); "
                      "remove it from the recipe or set it to its default, 0.01"),
                     (["model.balance=none", "model.aux_loss_coeff=0"], "model.aux_loss_coeff: does not apply"),
                     (["model.balance=sequence", "model.bias_update_rate=0.1"],
                      "model.bias_update_rate: does not apply to balance=sequence"),
                     (["model.z_loss_coeff=-1"], "model.z_loss_coeff: must be a finite number >= 0")):
        with pytest.raises(ConfigError, match=msg):
            load_config(None, bad)


def test_init_from_keeps_the_recipes_balance_and_imports_a_zero_bias_export_refuses_a_trained_one(tmp_path):
    hub = transformers.Qwen3MoeConfig(vocab_size=264, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    transformers.Qwen3MoeForCausalLM(hub).save_pretrained(tmp_path / "hub")
    cfg = config_from_dict({"model": {"balance": "bias", "bias_update_rate": 0.02, "z_loss_coeff": 0.1},
                            "train": {"init_from": str(tmp_path / "hub")}})
    assert (cfg.model.num_experts, cfg.model.balance, cfg.model.bias_update_rate, cfg.model.z_loss_coeff) == \
        (4, "bias", 0.02, 0.1)
    model = load_hf(tmp_path / "hub", balance="bias")
    bias = model.layers[0].mlp.balance.bias_E
    assert bias.dtype == torch.float32 and torch.equal(bias, torch.zeros(4))  # not left uninitialised
    save_hf(model, tmp_path / "out")  # a zero bias changes nothing: the hub format without it is exact
    bias[1] = 0.5
    with pytest.raises(ValueError, match="layers.0.mlp.balance.bias_E: the trained routing bias"):
        save_hf(model, tmp_path / "out2")


def test_export_refuses_a_checkpoint_with_a_trained_routing_bias(tmp_path, capsys):
    """The streaming export reads hub tensors only: without this check a trained balance=bias
    bias was left out silently (save_hf refuses it, above)."""
    from pithtrain.checkpoint import export
    from pithtrain.train import train
    base = ["model.balance=bias", "model.bias_update_rate=0.01", "model.hidden_size=32", "model.num_layers=1",
            "model.num_heads=4", "model.head_dim=8", "model.moe_intermediate_size=16", "train.seq_len=32",
            "train.micro_batch_size=2", "train.steps=2", "train.warmup_steps=1", "data.max_bytes=20000",
            "train.device=cpu", f"log.run_dir={tmp_path / 'run'}"]
    train(load_config(None, base))
    capsys.readouterr()
    assert export.main(["--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "layers.0.mlp.balance.bias_E: the trained routing bias (model.balance=bias)" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "hf" / "config.json").exists()


# ---------------------------------------------------------------------------------------------
# Checkpoint and resume


def test_bias_survives_checkpoint_and_resume_bit_exactly(tmp_path, monkeypatch):
    from pithtrain.data import TokenBatches
    from pithtrain.train import train
    base = ["model.balance=bias", "model.bias_update_rate=0.01", "model.hidden_size=32", "model.num_layers=2",
            "model.num_heads=4", "model.head_dim=8", "model.moe_intermediate_size=16", "train.seq_len=32",
            "train.micro_batch_size=2", "train.steps=6", "train.warmup_steps=1", "checkpoint.every=3",
            "data.max_bytes=20000", "log.every=1", "train.device=cpu"]
    straight = tmp_path / "a"
    _, model_a = train(load_config(None, base + [f"log.run_dir={straight}"]))
    run, real = tmp_path / "b", TokenBatches.batch

    class Stop(Exception):
        pass

    def batch_until_3(self, step):
        if step == 3:
            raise Stop
        return real(self, step)

    monkeypatch.setattr(TokenBatches, "batch", batch_until_3)
    with pytest.raises(Stop):
        train(load_config(None, base + [f"log.run_dir={run}"]))
    monkeypatch.setattr(TokenBatches, "batch", real)
    _, model_b = train(load_config(None, base + [f"log.run_dir={run}"]))
    a, b = model_a.state_dict(), model_b.state_dict()
    assert "layers.0.mlp.balance.bias_E" in a and a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert a["layers.1.mlp.balance.bias_E"].abs().sum() > 0  # the bias did move


# ---------------------------------------------------------------------------------------------
# Every rank holds the same bias (gloo); the context-parallel sequence loss equals one process

MODEL = dict(family="qwen3_moe", vocab_size=264, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=8, moe_intermediate_size=16, num_experts=8, top_k=2)
LAYOUTS = {"ep=2": (dict(fsdp=2, ep=2), dict(balance="bias", bias_update_rate=0.01)),
           "dp=2": (dict(dp=2), dict(balance="bias", bias_update_rate=0.01)),
           "cp=2": (dict(cp=2), dict(balance="sequence", aux_loss_coeff=0.05, z_loss_coeff=0.01))}


def dist_cfg(name, run_dir, grad_accum=1, parallel=None):
    par, bal = LAYOUTS[name]
    return config_from_dict({
        "model": {**MODEL, **bal}, "parallel": par if parallel is None else parallel,
        "train": dict(steps=3, micro_batch_size=2, seq_len=16, grad_accum=grad_accum, warmup_steps=1, device="cpu"),
        "data": dict(max_bytes=20000), "checkpoint": dict(final=False), "log": dict(every=1, run_dir=run_dir)})


def _biases(model):
    return {n: b.tolist() for n, b in model.named_buffers() if n.endswith("bias_E")}


def _dist_worker(rank, world, port, tmp):
    import torch.distributed as dist

    from pithtrain.train import train
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for name in LAYOUTS:
        hist, model = train(dist_cfg(name, os.path.join(tmp, f"r{rank}-{name}")))
        every = [None] * world
        dist.all_gather_object(every, _biases(model))
        out[name] = {"biases": every, "loss": [h["loss"] for h in hist], "gnorm": [h["grad_norm"] for h in hist]}
    if rank == 0:
        with open(os.path.join(tmp, "dist.json"), "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bias_identical_on_every_rank_and_cp_sequence_loss_equals_one_process(tmp_path):
    """gloo, 2 processes, 3 steps. ep=2 and dp=2 with balance=bias: every rank's bias is the same,
    and the one process's on the same global batch (the load is summed over the ranks before the
    update). cp=2 with balance=sequence + z-loss: losses and gradient norms equal one process's."""
    from pithtrain.train import train
    refs = {}
    for name in LAYOUTS:
        accum = 1 if name == "cp=2" else 2  # the same global batch as the 2 batch ranks
        hist, model = train(dist_cfg(name, str(tmp_path / f"ref-{name}"), grad_accum=accum, parallel={}))
        refs[name] = {"biases": _biases(model), "loss": [h["loss"] for h in hist],
                      "gnorm": [h["grad_norm"] for h in hist]}
    spawn(_dist_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    out = json.loads((tmp_path / "dist.json").read_text())
    for name in ("ep=2", "dp=2"):
        ranks = out[name]["biases"]
        assert len(ranks[0]) == 2 and ranks[0] == ranks[1], name  # both MoE layers, every rank
        assert ranks[0] == refs[name]["biases"], name
        assert any(v != 0 for b in ranks[0].values() for v in b)
    cp, ref = out["cp=2"], refs["cp=2"]
    for k in ("loss", "gnorm"):
        assert max(abs(a - b) / abs(b) for a, b in zip(cp[k], ref[k])) < 1e-5, (k, cp[k], ref[k])


# ---------------------------------------------------------------------------------------------
# A skewed router: bias evens the load out over 100 steps, none does not


def test_bias_evens_out_a_skewed_router_over_100_steps(tmp_path):
    """GPT-OSS from a hub checkpoint whose router bias sends almost every token to experts 0 and
    1 (max/mean load 4 of 8 experts), trained 100 steps at a small learning rate with balance=none
    and balance=bias: the logged per-layer load of the last 20 steps."""
    from pithtrain.train import train
    hub = transformers.GptOssConfig(vocab_size=264, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                                    layer_types=["full_attention"], num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=8, num_local_experts=8, num_experts_per_tok=2, sliding_window=8)
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(hub).float()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.05)
        hf.model.layers[0].mlp.router.bias.copy_(torch.tensor([4.0, 4.0, 0, 0, 0, 0, 0, 0]))
    hf.save_pretrained(tmp_path / "hub")
    last = {}
    for balance in ("none", "bias"):
        run = tmp_path / balance
        extra = {"bias_update_rate": 0.05} if balance == "bias" else {}
        train(config_from_dict({
            "model": {"balance": balance, **extra},
            "train": dict(steps=100, micro_batch_size=4, seq_len=32, lr=1e-4, warmup_steps=1, device="cpu",
                          init_from=str(tmp_path / "hub")),
            "data": dict(max_bytes=20000), "checkpoint": dict(final=False),
            "log": dict(every=1, run_dir=str(run))}))
        recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert len(recs) == 100 and recs[0]["load_max_mean"]["0"] > 3.5  # skewed at the start
        last[balance] = sum(r["load_max_mean"]["0"] for r in recs[-20:]) / 20
    print(f"layer 0 load max/mean, mean of the last 20 of 100 steps: {last}")
    assert last["none"] > 3.5 and last["bias"] < 2.0, last
