"""Phased chunk execution (distributed/overlap.py) equals the model's own forward and backward:
full backward, input-only + weight backward (B + W), and the interleaved forward-backward pair,
on CPU; on a GPU (marked) the two-stream overlapped step equals the sequential one."""

import pytest
import torch

from pithtrain.distributed import overlap
from pithtrain.distributed.pipeline import Chunk
from pithtrain.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

CFG = dict(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
           intermediate_size=48, moe_intermediate_size=16, num_experts=4, top_k=2, mlp_only_layers=[1],
           aux_loss_coeff=0.01)


def build(device="cpu", seed=0):
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CFG)).to(device)
    model.init_weights()
    return model


def batch(i, device="cpu", B=2, S=12):
    g = torch.Generator().manual_seed(100 + i)
    ids = torch.randint(0, CFG["vocab_size"], (B, S + 1), generator=g)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def whole_chunk():
    return Chunk(0, list(range(CFG["num_layers"])), first=True, last=True)


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
    run = overlap.start(overlap.chunk_phases(model, whole_chunk(), positions(x), y), x)
    overlap.forward(run)
    return run


def test_phased_full_and_split_backward_match_the_model():
    model = build()
    mbs = [batch(0), batch(1)]
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
        got = grads(model)
        assert got.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-7, msg=n)


def overlapped_step(model, streams):
    """F(mb0); F(mb1) overlapped with BW(mb0); BW(mb1)."""
    model.zero_grad()
    (x0, y0), (x1, y1) = batch(0, model.lm_head.weight.device), batch(1, model.lm_head.weight.device)
    r0 = run_chunk(model, x0, y0)
    r1 = overlap.start(overlap.chunk_phases(model, whole_chunk(), positions(x1), y1), x1)
    g = torch.tensor(1 / 100, device=x0.device)
    order = overlap.forward_backward(r1, r0, g, streams)
    overlap.backward(r1, g)
    return [r0.output.detach(), r1.output.detach()], grads(model), order


def test_interleaved_forward_backward_matches_the_model_on_cpu():
    model = build()
    ref_losses, ref = reference(model, [batch(0), batch(1)])
    losses, got, order = overlapped_step(model, None)
    paired = [p for p in order if p[0] and p[1]]
    assert paired, order  # some communication phase was paired with a compute phase
    for a, b in zip(losses, ref_losses):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.gpu
def test_two_stream_overlapped_step_equals_sequential_on_gpu():
    """On one GPU the dispatch / combine phases run on the communication stream while the other
    micro-batch's compute runs on the compute stream. Same losses and gradients as the one-stream
    run of the same interleaving and as the plain model (float32; TF32 off). On one GPU without
    expert parallelism there is no all-to-all to hide, so this proves correctness, not speed:
    with EP over several GPUs the dispatch/combine all-to-all is what runs under the other
    micro-batch's attention and expert matmuls (see pipeline.py's docstring)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    model = build(dev)
    ref_losses, ref = reference(model, [batch(0, dev), batch(1, dev)])
    seq_losses, seq, _ = overlapped_step(model, None)
    two_losses, two, order = overlapped_step(model, overlap.Streams(dev))
    torch.cuda.synchronize()
    assert any(p[0] and p[1] for p in order)
    # index_add (combine) uses atomics on CUDA, so sums may reassociate between runs: float32
    # round-off, not bit equality.
    for a, b, c in zip(two_losses, seq_losses, ref_losses):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    for n in ref:
        torch.testing.assert_close(two[n], seq[n], rtol=1e-5, atol=1e-6, msg=n)
        torch.testing.assert_close(two[n], ref[n], rtol=1e-4, atol=1e-5, msg=n)


class CallOnlyDispatcher:
    """A dispatcher with one call (like the expert-parallel one): the layer gets a single "moe"
    communication phase instead of dispatch / experts / combine."""

    def __init__(self):
        from pithtrain.models.common import LocalDispatcher
        self.inner = LocalDispatcher()

    def __call__(self, x_TD, idx_TA, w_TA, experts):
        return self.inner(x_TD, idx_TA, w_TA, experts)


def test_one_call_dispatcher_phase_matches_the_model():
    model = build()
    for layer in model.layers:
        if hasattr(layer.mlp, "dispatcher"):
            layer.mlp.dispatcher = CallOnlyDispatcher()
    ref_losses, ref = reference(model, [batch(0), batch(1)])
    losses, got, order = overlapped_step(model, None)
    names = {n for pair in order for n in pair if n}
    assert "moe0" in names and "dispatch0" not in names
    for a, b in zip(losses, ref_losses):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-7, msg=n)
