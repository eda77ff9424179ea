"""Blockwise FP8 (pithtrain/kernels/fp8_linear.py) on CPU: the PyTorch reference operators, the autograd wiring
(forward and data grad each equal to the matmul of the dequantised operands, the weight grad to
the unquantised product), the per-step weight cache, the model hook, and the trainer's refusal on
CPU.

Error bound of e4m3 with scale s = amax / 448: a scaled value v = x / s rounds to 3 mantissa bits,
|v - q| <= 2^-4 |v| for normals (|v| >= 2^-6) and <= 2^-10 for subnormals, so
|x - q s| <= 2^-4 |x| + 2^-10 s. The Triton kernels give the same scales and codes up to one
e4m3 step (tests/test_fp8_gpu.py)."""

import pytest
import torch
from run_path import one_gpu_kernels

from pithtrain.config import ConfigError, load_config
from pithtrain.kernels import fp8_linear as fp8
from pithtrain.models import build_model
from pithtrain.models.common import use_kernels
from pithtrain.train import train


def bound_ok(x, deq, s_full):
    return bool(((x - deq).abs() <= (x.abs() * 2 ** -4 + s_full * 2 ** -10) * (1 + 1e-6)).all())


@pytest.mark.quick
def test_quant_rows_within_the_format_bound_and_max_exact():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 300, generator=g) * torch.logspace(-3, 3, 300)  # tiles of very different size
    x[5, :128] = 0  # an all-zero tile stays zero, no NaN
    q, s = fp8.quant_rows(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (70, 300) and s.shape == (3, 70)
    deq = fp8.dequant_rows(q, s)
    s_full = s.t().repeat_interleave(128, 1)[:, :300]
    assert bound_ok(x, deq, s_full)
    assert torch.isfinite(deq).all() and (deq[5, :128] == 0).all()
    # each tile's largest magnitude maps to +-448 exactly (the whole e4m3 range is used)
    tile_max = x[:, :128].abs().amax(1)
    assert torch.allclose(deq[:, :128].abs().amax(1), tile_max, rtol=1e-6)
    nonzero = tile_max > 0
    assert (q.float()[:, :128].abs().amax(1)[nonzero] == 448).all()


def test_quant_blocks_bound_and_transposed_copy():
    w = torch.randn(3, 200, 130) * 0.02
    q, qt, s = fp8.quant_blocks(w)
    assert s.shape == (3, 2, 2) and qt.shape == (3, 130, 200)
    assert torch.equal(qt.float(), q.transpose(1, 2).float())
    s_full = s.repeat_interleave(128, 1)[:, :200].repeat_interleave(128, 2)[:, :, :130]
    assert bound_ok(w, fp8.dequant_blocks(q, s), s_full)
    for r, c in ((slice(0, 128), slice(0, 128)), (slice(128, 200), slice(128, 130))):  # full and edge blocks
        assert (q.float()[:, r, c].abs().amax((1, 2)) == 448).all()  # each block's max is +-448


def _grouped_case(counts=(100, 0, 37, 120), K=200, N=136, seed=0):
    g = torch.Generator().manual_seed(seed)
    offs = torch.tensor(counts).cumsum(0)
    x = torch.randn(int(offs[-1]), K, generator=g)
    w = torch.randn(len(counts), K, N, generator=g) / K ** 0.5
    return x, w, offs


def test_grouped_mm_forward_and_grads_are_the_dequantised_products():
    """Forward and data grad equal the fp32 product of exactly the FP8 operands the recipe says; the
    weight grad is the unquantised product (computed in the activations' precision)."""
    x, w, offs = _grouped_case()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.FP8GroupedMM()(xr, wr, offs)
    dy = torch.randn_like(y)
    y.backward(dy)
    bounds = [0] + offs.tolist()
    wq, _, ws = fp8.quant_blocks(w)
    W = fp8.dequant_blocks(wq, ws)
    X = fp8.dequant_rows(*fp8.quant_rows(x))
    DY = fp8.dequant_rows(*fp8.quant_rows(dy))
    for e in range(len(bounds) - 1):
        a, b = bounds[e], bounds[e + 1]
        torch.testing.assert_close(y[a:b], X[a:b] @ W[e], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xr.grad[a:b], DY[a:b] @ W[e].t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(wr.grad[e], x[a:b].t() @ dy[a:b], rtol=1e-5, atol=1e-5)
    assert (wr.grad[1] == 0).all()  # the empty group gets a zero gradient


def test_grouped_mm_close_to_full_precision():
    """Against unquantised fp32: random normal data lands at ~3.7% relative (two operands, each
    ~2.6% RMS); 6% = 2^-4, the per-element worst case, is the tolerance."""
    x, w, offs = _grouped_case(counts=(256, 300, 200), K=512, N=384, seed=1)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.FP8GroupedMM()(xr, wr, offs)
    dy = torch.randn_like(y)
    y.backward(dy)
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    y2 = torch.cat([x2[a:b] @ w2[e] for e, (a, b) in enumerate(zip([0] + offs.tolist(), offs.tolist()))])
    y2.backward(dy)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()
    assert rel(y, y2) < 2 ** -4 and rel(xr.grad, x2.grad) < 2 ** -4 and rel(wr.grad, w2.grad) < 2 ** -4


def test_no_rows():
    x, w, offs = _grouped_case(counts=(0, 0))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.FP8GroupedMM()(xr, wr, offs)
    assert y.shape == (0, 136)
    y.sum().backward()
    assert (wr.grad == 0).all() and xr.grad.shape == (0, 200)


def test_weight_cache_quantises_once_per_step_and_never_serves_stale_copies():
    cache = fp8.WeightCache()
    w = torch.nn.Parameter(torch.randn(2, 128, 128))
    first = cache.weights(w, w)
    for _ in range(3):  # micro-batches of one optimizer step
        assert cache.weights(w, w) is first
    assert cache.quantised == 1
    with torch.no_grad():
        w.mul_(2)  # changed in place without next_step: the version counter catches it
    again = cache.weights(w, w)
    assert cache.quantised == 2 and torch.allclose(again[2], 2 * first[2])
    cache.next_step()
    cache.weights(w, w)
    assert cache.quantised == 3
    local = w.detach().clone()  # its own storage and version counter, as a DTensor's to_local()
    cache.weights(w, local)
    assert cache.quantised == 4  # another tensor than the cached one
    cache.weights(w, local)
    with torch.no_grad():
        local.add_(1)  # written through the local tensor only: the owner's version does not move
    cache.weights(w, local)
    assert cache.quantised == 5
    # a parameter that dies (a step's bf16 weight copy, precision.WeightCopies) takes its copies
    # with it: evaluation's copies do not stay next to the next step's
    copy = torch.nn.Parameter(w.detach().to(torch.bfloat16))
    cache.weights(copy, copy)
    assert cache.quantised == 6 and len(cache._entries) == 2
    del copy
    assert len(cache._entries) == 1
    cache.weights(w, local)
    assert cache.quantised == 6  # w's own copies are untouched


def test_model_hook_quantises_each_expert_weight_once_per_step(tiny_overrides):
    """A tiny Qwen3-MoE with FP8 experts (PyTorch reference operators on CPU): two micro-batches
    and an optimizer step quantise each routed-expert weight once; loss and gradients stay close
    to the same model's without FP8."""
    cfg = load_config(None, tiny_overrides)
    torch.manual_seed(0)
    model = use_kernels(build_model(cfg.model, "cpu"), one_gpu_kernels("torch", "cpu", fp8=True))
    ids = torch.randint(0, cfg.model.vocab_size, (2, 33))
    q0 = fp8.quantised(model)
    losses = []
    for _ in range(2):
        loss = model(ids[:, :-1], labels_BS=ids[:, 1:])
        loss.backward()
        losses.append(loss.item())
    n_expert_weights = 2 * cfg.model.num_layers  # w13 and w2 per MoE layer
    assert fp8.quantised(model) - q0 == n_expert_weights
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    fp8.next_step(model)
    model(ids[:, :-1], labels_BS=ids[:, 1:])
    assert fp8.quantised(model) - q0 == 2 * n_expert_weights

    torch.manual_seed(0)
    ref = build_model(cfg.model, "cpu")
    ref_loss = ref(ids[:, :-1], labels_BS=ids[:, 1:])
    ref_loss.backward()
    assert losses[0] == pytest.approx(ref_loss.item(), rel=1e-2)
    # Expert gradients pass through FP8 GEMMs upstream (forward, and w2's data grad into w13's
    # weight grad), each ~3.7% relative on its own, and a few tokens change experts when layer 0's
    # output moves: so the check is on direction (cosine), not on size.
    for n, p in ref.named_parameters():
        if "experts" in n:
            g = grads[n] / 2  # two backward passes accumulated
            assert torch.nn.functional.cosine_similarity(g.flatten(), p.grad.flatten(), dim=0) > 0.97, n


def test_fp8_recipe_refused_on_cpu(tiny_overrides):
    cfg = load_config(None, tiny_overrides + ["train.fp8=true"])
    with pytest.raises(ConfigError, match="train.fp8: FP8 training needs a Hopper or Blackwell GPU"):
        train(cfg)
