"""A layer's phases (common.DecoderLayer.phases, which its `forward` runs) executed one by one with
autograd cut between them (distributed/overlap.py) equal the model's own forward and backward, for
every family: full backward, input-only + weight backward (B + W), and the interleaved
forward-backward pair, on CPU; on a GPU (marked) the two-stream overlapped step equals the
sequential one at full width for the three families."""

import dataclasses

import pytest
import torch
import variant

from pithtrain.distributed import overlap
from pithtrain.distributed.pipeline import Chunk
from pithtrain.models import FAMILIES

# Tiny widths that still exercise each family's features: Qwen3 with a dense layer; DeepSeek-V2
# with MLA, shared experts and a dense first layer; GPT-OSS with sinks, a sliding window shorter
# than the sequence and biased experts.
TINY = {
    "qwen3_moe": dict(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                      intermediate_size=48, moe_intermediate_size=16, num_experts=4, top_k=2,
                      mlp_only_layers=[1], aux_loss_coeff=0.01),
    "deepseek_v2": dict(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1,
                        intermediate_size=48, moe_intermediate_size=16, num_experts=4, n_shared_experts=1,
                        top_k=2, aux_loss_coeff=0.01),
    "gpt_oss": dict(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                    intermediate_size=16, num_experts=4, top_k=2, sliding_window=4, aux_loss_coeff=0.01),
}


def build(family, device="cpu", seed=0, **over):
    torch.manual_seed(seed)
    cfg_cls, model_cls = FAMILIES[family][0], FAMILIES[family][1]
    model = model_cls(cfg_cls(**variant.model({**TINY[family], **over}, family))).to(device)
    model.init_weights()
    return model


def batch(i, vocab, device="cpu", B=2, S=12):
    g = torch.Generator().manual_seed(100 + i)
    ids = torch.randint(0, vocab, (B, S + 1), generator=g)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def whole_chunk(model):
    return Chunk(0, list(range(model.cfg.num_layers)), first=True, last=True)


def positions(x):
    return torch.arange(x.shape[1], device=x.device).expand_as(x)


def reference(model, mbs):
    model.zero_grad()
    losses = []
    for x, y in mbs:
        loss = model(x, labels_BS=y)
        (loss / 100).backward()
        losses.append(loss.detach())
    return losses, grads(model)


def run_chunk(model, x, y):
    run = overlap.start(overlap.chunk_phases(model, whole_chunk(model), positions(x), y), x)
    overlap.forward(run)
    return run


def batch_pos(V):
    x, y = batch(0, V)
    return positions(x), y


def check_grads(got, ref, rtol=1e-5, atol=1e-7):
    assert got.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("family", sorted(TINY))
def test_every_family_splits_into_phases(family):
    """A MoE layer of every family has the six phases, dispatch and combine marked communication;
    a dense layer (Qwen3 mlp_only_layers, DeepSeek's first layer) has two."""
    model = build(family)
    x, y = batch(0, model.cfg.vocab_size)
    names = [(ph.name, ph.comm) for ph in overlap.chunk_phases(model, whole_chunk(model), positions(x), y)]
    moe = ["attn", "route", "dispatch", "experts", "combine", "residual"]
    kinds = {"qwen3_moe": ["moe", "dense", "moe"], "deepseek_v2": ["dense", "moe", "moe"],
             "gpt_oss": ["moe", "moe", "moe"]}[family]
    want = [("embed", False)]
    for i, kind in enumerate(kinds):
        want += [(f"{n}{i}", n in ("dispatch", "combine")) for n in (moe if kind == "moe" else ["attn", "mlp"])]
    assert names == want + [("head", False)]


@pytest.mark.quick
@pytest.mark.parametrize("family", sorted(TINY))
def test_phased_full_and_split_backward_match_the_model(family):
    """forward vs phases: the same losses (bit-equal: the same calls) and every gradient, with
    the full backward and with B then W."""
    model = build(family)
    mbs = [batch(0, model.cfg.vocab_size), batch(1, model.cfg.vocab_size)]
    ref_losses, ref = reference(model, mbs)
    for split in (False, True):
        model.zero_grad()
        runs = []
        for (x, y), ref_loss in zip(mbs, ref_losses):
            runs.append(run_chunk(model, x, y))
            torch.testing.assert_close(runs[-1].output.detach(), ref_loss, rtol=0, atol=0)
            overlap.backward(runs[-1], torch.tensor(1 / 100), input_only=split)
        if split:  # B left every weight gradient to W
            assert all(p.grad is None for p in model.parameters())
            for run in runs:
                overlap.weight_backward(run)
        check_grads(grads(model), ref)


@pytest.mark.quick
@pytest.mark.parametrize("family", sorted(TINY))
def test_in_place_weight_gradients_match_autograd(family, monkeypatch):
    """kernels/wgrad.py (the weight gradients of the experts, the token embedding and the LM head
    added into .grad from the second micro-batch on; on CPU, float32, the reference's GEMM and add
    stand in for the Triton kernel) gives autograd's gradients through the model's forward, the
    phases' full backward and the pipeline's B then W (B, on the phases' leaf inputs, adds nothing
    to .grad); autograd.grad w.r.t. those weights returns them and leaves .grad alone. The kernel:
    tests/test_kernels_gpu.py."""
    from pithtrain.kernels import NAMES, wgrad
    from pithtrain.models.common import GroupedExperts, grouped_mm, use_kernels

    model = build(family)
    use = {**dict.fromkeys(NAMES, False), "linear_ce": True}
    use_kernels(model, use)  # the reference: the same ops, gradients through autograd
    mbs = [batch(0, model.cfg.vocab_size), batch(1, model.cfg.vocab_size)]
    _, ref = reference(model, mbs)
    use_kernels(model, {**use, "wgrad": True, "wgrad_ends": True})
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert all(m.mm.func is wgrad.grouped_mm for m in experts) and model.embed_tokens.lookup.func is wgrad.embedding
    calls, add = [], wgrad.accumulate
    monkeypatch.setattr(wgrad, "accumulate", lambda g, *a, **k: calls.append(g.shape) or add(g, *a, **k))
    _, got = reference(model, mbs)
    check_grads(got, ref)
    assert len(calls) == 2 * len(experts)  # w13 and w2, second micro-batch
    counted = {n: p.wgrad_adds for n, p in model.named_parameters() if hasattr(p, "wgrad_adds")}
    assert counted["embed_tokens.weight"] == counted["lm_head.weight"] == 1, counted
    assert wgrad.in_place_adds(model) == len(calls) + 2  # the witness the bench reports
    for split in (False, True):
        model.zero_grad()
        calls.clear()
        runs = []
        for x, y in mbs:
            runs.append(run_chunk(model, x, y))
            overlap.backward(runs[-1], torch.tensor(1 / 100), input_only=split)
        if split:
            assert all(p.grad is None for p in model.parameters()) and not calls
            for run in runs:
                overlap.weight_backward(run)
        check_grads(grads(model), ref)
        assert len(calls) == 2 * len(experts)
        assert wgrad.in_place_adds(model) == sum(counted.values()) + len(calls) + 2  # the head and embedding too
        counted = {n: p.wgrad_adds for n, p in model.named_parameters() if hasattr(p, "wgrad_adds")}
    ws = [w for m in experts for w in (m.w13_EDF2, m.w2_EFD)] + [model.embed_tokens.weight, model.lm_head.weight]
    x, y = mbs[0]
    for w in ws:
        w.grad = torch.zeros_like(w)
    got = torch.autograd.grad(model(x, labels_BS=y), ws)
    use_kernels(model, use)
    assert all(m.mm is grouped_mm for m in experts)
    want = torch.autograd.grad(model(x, labels_BS=y), ws)
    for g, r, w in zip(got, want, ws):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
        assert not w.grad.any()


def overlapped_step(model, streams):
    """F(mb0); F(mb1) overlapped with BW(mb0); BW(mb1)."""
    model.zero_grad()
    dev, V = model.lm_head.weight.device, model.cfg.vocab_size
    (x0, y0), (x1, y1) = batch(0, V, dev), batch(1, V, dev)
    timeline = []
    r0 = overlap.start(overlap.chunk_phases(model, whole_chunk(model), positions(x0), y0), x0, mb=0,
                       timeline=timeline)
    overlap.forward(r0)
    r1 = overlap.start(overlap.chunk_phases(model, whole_chunk(model), positions(x1), y1), x1, mb=1,
                       timeline=timeline)
    g = torch.tensor(1 / 100, device=dev)
    order = overlap.forward_backward(r1, r0, g, streams)
    overlap.backward(r1, g)
    return [r0.output.detach(), r1.output.detach()], grads(model), order, timeline


@pytest.mark.parametrize("family", sorted(TINY))
def test_interleaved_forward_backward_matches_the_model_on_cpu(family):
    """The F&B pair: every dispatch / combine of either micro-batch is paired with a compute
    phase of the other; losses and gradients are the model's."""
    model = build(family)
    V = model.cfg.vocab_size
    ref_losses, ref = reference(model, [batch(0, V), batch(1, V)])
    losses, got, order, timeline = overlapped_step(model, None)
    fb = [e for e in timeline if (e["pass_"], e["mb"]) in (("F", 1), ("BW", 0))]
    comm = [e for e in fb if e["comm"]]
    phases = overlap.chunk_phases(model, whole_chunk(model), *batch_pos(V))
    n_moe = sum(1 for ph in phases if ph.name.startswith("dispatch"))
    assert len(comm) == 2 * 2 * n_moe  # dispatch and combine of both micro-batches
    for e in comm:
        partner = [o for o in fb if e["pair"] is not None and o["pair"] == e["pair"] and o is not e]
        assert len(partner) == 1 and not partner[0]["comm"] and partner[0]["mb"] != e["mb"], (e, order)
    for a, b in zip(losses, ref_losses):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    check_grads(got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(TINY))
def test_two_stream_overlapped_step_equals_sequential_on_gpu(family):
    """On one GPU the dispatch / combine phases run on the communication stream while the other
    micro-batch's compute runs on the compute stream. Same losses and gradients as the one-stream
    run of the same interleaving and as the plain model (float32; TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    model = build(family, dev)
    V = model.cfg.vocab_size
    ref_losses, ref = reference(model, [batch(0, V, dev), batch(1, V, dev)])
    seq_losses, seq, _, _ = overlapped_step(model, None)
    two_losses, two, order, _ = overlapped_step(model, overlap.Streams(dev))
    torch.cuda.synchronize()
    assert any(p[0] and p[1] for p in order)
    # index_add (combine) uses atomics on CUDA, so sums may reassociate between runs: float32
    # round-off, not bit equality.
    for a, b, c in zip(two_losses, seq_losses, ref_losses):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    check_grads(two, seq, rtol=1e-5, atol=1e-6)
    check_grads(two, ref, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Full width on the GPU

FULL = {"deepseek_v2": "deepseek-v2-lite", "qwen3_moe": "qwen3-30b-a3b", "gpt_oss": "gpt-oss-20b"}


@pytest.mark.gpu
def test_full_width_phases_on_two_streams_match():
    """One GPU, the three families at full width (2 layers: DeepSeek-V2-Lite's dense first layer
    and a MoE layer; two MoE layers for Qwen3-30B-A3B and GPT-OSS-20B, GPT-OSS's sliding and full
    attention): the two-stream F&B step equals the one-stream one (float32, TF32 off; relative
    error per gradient tensor < 1e-4: the combine's index_add uses atomics on CUDA). The costs the
    performance model reads are measured on train.py's own path instead: scripts/calibrate.py."""
    from pithtrain.config import load_config

    dev = torch.device("cuda")
    for family, recipe in FULL.items():
        full = load_config(recipe, []).model
        small = dataclasses.replace(full, num_layers=2)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.manual_seed(0)
        model = FAMILIES[family][1](small).to(dev)
        model.init_weights()
        _, seq, _, _ = overlapped_step(model, None)
        _, two, order, _ = overlapped_step(model, overlap.Streams(dev))
        torch.cuda.synchronize()
        assert any(p[0] and p[1] for p in order)
        for n in seq:
            err = ((two[n] - seq[n]).norm() / seq[n].norm().clamp_min(1e-30)).item()
            assert err < 1e-4, (family, n, err)
        torch.backends.cuda.matmul.allow_tf32 = True
        del model
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# The pipeline's recorded step is timed like the others


def one_rank_runner(model, M, device):
    """pipeline.PipelineRunner of a one-stage 1F1B schedule (no sends: no process group needed)."""
    from pithtrain.distributed import pipeline
    chunks = pipeline.rank_chunks(0, 1, "1f1b", model.cfg.num_layers)
    ops = pipeline.build_schedule("1f1b", 1, M)[0]
    return pipeline.PipelineRunner(pipeline.attach_ends(model), chunks, ops, 0, 1, "1f1b", M, None, None,
                                   (2, 12, model.cfg.hidden_size), torch.device(device))


class FakeEvent:
    """torch.cuda.Event on a CPU machine: its time is the host clock when recorded."""
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        import time
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def test_the_recorded_pipeline_step_is_timed_by_events_without_a_synchronisation_per_op(monkeypatch):
    """The last step of a pipeline run records its timeline (pipeline_viz) from events around each
    op, resolved after the step: one synchronisation for the step, not one per op, so its
    tokens/s reads as the others' do (CUDA faked here with host-clock events; on a GPU:
    test_the_recorded_pipeline_step_synchronises_once_on_cuda). The times are the ops' own."""
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    model = build("qwen3_moe")
    runner = one_rank_runner(model, 3, "cpu")
    runner.cuda = True  # the step's CUDA path: events, not the host clock
    runner.timeline = []
    mbs = [batch(i, 64) for i in range(3)]
    runner.step(mbs, 3 * 24)
    assert len(syncs) == 1 and len(runner.timeline) == 6  # F and BW of each micro-batch
    assert all(0 <= e["start"] <= e["end"] for e in runner.timeline)
    assert all(a["end"] <= b["start"] for a, b in zip(runner.timeline, runner.timeline[1:]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_recorded_pipeline_step_synchronises_once_on_cuda(monkeypatch):
    """On a GPU (one stage: no second GPU needed): recording the timeline synchronises once per
    step (the last step once synchronised after every op, so its tokens/s read low)."""
    real, syncs = torch.cuda.synchronize, []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device) or real(device))
    runner = one_rank_runner(build("qwen3_moe", "cuda"), 3, "cuda")
    runner.timeline = []
    runner.step([batch(i, 64, "cuda") for i in range(3)], 3 * 24)
    assert len(syncs) <= 1 and len(runner.timeline) == 6 and all(e["end"] > e["start"] for e in runner.timeline)
