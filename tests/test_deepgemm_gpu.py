"""DeepGEMM's FP8 expert GEMMs on the GPU (`pytest -m gpu tests/test_deepgemm_gpu.py` after building
DeepGEMM with images/build_deepgemm.sh).

At each bench family's expert shapes (all experts, ~64 rows each, every 7th empty), through
deepgemm.FP8GroupedMM: forward, data grad and weight grad within 2^-4 = 6.25% relative of bf16
grouped_mm (tests/test_fp8_gpu.py's bound for the Triton FP8 path) and within 1e-2 of the PyTorch
reference on the same quantisation (deepgemm.REFERENCE); the quantisation into the padded layout
against the reference; the padded layout's Triton kernel against its PyTorch form; no host
synchronisation in a forward and backward; the weight gradient added in place over two micro-batches."""

import pytest
import torch
import torch.nn.functional as F

from pithtrain.config import load_config
from pithtrain.kernels import deepgemm

tk = pytest.importorskip("pithtrain.kernels.fp8")  # Triton
from test_kernels_gpu import rel  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
WHY: list = []
DG = deepgemm.load(WHY) if torch.cuda.is_available() else None
need_dg = pytest.mark.skipif(DG is None, reason=f"deep_gemm not importable: {'; '.join(WHY)}")


def _shape(recipe):
    """(experts, hidden, expert width) of a recipe; w13 (D -> 2F), w2 (F -> D)."""
    m = load_config(recipe).model
    return m.num_experts, m.hidden_size, getattr(m, m.expert_width_field)


SHAPES = {n: _shape(n) for n in ("qwen3-30b-a3b", "deepseek-v2-lite", "gpt-oss-20b")}
CASES = [(name, which) for name in SHAPES for which in ("w13", "w2")]


def _case(name, which, rows=64, seed=0):
    E, D, F_ = SHAPES[name]
    K, N = (D, 2 * F_) if which == "w13" else (F_, D)
    g = torch.Generator(device="cuda").manual_seed(seed)
    counts = torch.randint(0, 2 * rows, (E,), generator=g, device="cuda")
    counts[::7] = 0
    offs = counts.cumsum(0).int()
    x = torch.randn(int(offs[-1]), K, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.nn.Parameter((torch.randn(E, K, N, device="cuda", generator=g) / K ** 0.5).bfloat16())
    return x.requires_grad_(), w, offs


@need_dg
@pytest.mark.parametrize("name,which", CASES)
def test_fp8_forward_dgrad_wgrad_against_bf16_and_the_reference(name, which):
    x, w, offs = _case(name, which)
    y = deepgemm.FP8GroupedMM(DG)(x, w, offs)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    y_ref = F.grouped_mm(x, w, offs=offs)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), dy)
    assert rel(y, y_ref) < 2 ** -4 and rel(dx, dx_ref) < 2 ** -4 and rel(dw, dw_ref) < 2 ** -4
    nonempty = torch.diff(offs, prepend=offs.new_zeros(1)) > 0
    assert (dw[~nonempty] == 0).all()  # empty experts get no gradient
    # The same operands through the PyTorch reference (dequantise, fp32 products): only the
    # accumulation order differs.
    y2 = deepgemm.FP8GroupedMM()(x, w, offs)
    dx2 = torch.autograd.grad(y2, x, dy)[0]
    assert rel(y, y2) < 1e-2 and rel(dx, dx2) < 1e-2


@need_dg
def test_quantisation_into_the_padded_layout_matches_the_reference():
    x, _, offs = _case("qwen3-30b-a3b", "w2")
    lay = deepgemm.layout(offs, len(x))
    Mp = len(lay.m_indices)
    q, s = tk.quant_rows(x.detach(), rows=lay.rows, out_rows=Mp)
    q_ref, s_ref = deepgemm.REFERENCE.quant_padded(x.detach(), lay.rows, Mp)
    live = lay.m_indices >= 0
    torch.testing.assert_close(s[:, live], s_ref[:, live], rtol=1e-6, atol=0)
    assert (q[live].float() - q_ref[live].float()).abs().max() <= 32  # one e4m3 step at most (ties)


@need_dg
def test_no_host_synchronisation_in_forward_and_backward():
    x, w, offs = _case("deepseek-v2-lite", "w13")
    mm = deepgemm.FP8GroupedMM(DG)
    mm(x, w, offs).sum().backward()  # warm-up: JIT compilation, the weight cache
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mm(x, w, offs).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@need_dg
def test_weight_gradient_added_in_place_over_micro_batches():
    x1, w, offs = _case("qwen3-30b-a3b", "w13", seed=1)
    x2 = torch.randn_like(x1).requires_grad_()
    mm = deepgemm.FP8GroupedMM(DG, in_place=True)
    want = sum(torch.autograd.grad(F.grouped_mm(x, w, offs=offs).float().sum(), w)[0].float() for x in (x1, x2))
    for x in (x1, x2):
        mm(x, w, offs).float().sum().backward()
    assert getattr(w, "wgrad_adds", 0) == 1  # the second micro-batch's, added into p.grad
    assert rel(w.grad, want) < 1e-2
    assert mm.cache.quantised == 1  # one quantisation of w for both micro-batches (the step's cache)


def test_layout_kernel_matches_the_pytorch_layout():
    """deepgemm.layout on CUDA (fp8.padded_layout, one Triton kernel) against its PyTorch form."""
    g = torch.Generator().manual_seed(0)
    for counts in ([3, 0, 128, 129, 1], [0, 0, 5], [300], torch.randint(0, 1200, (128,), generator=g).tolist(),
                   torch.randint(0, 3, (256,), generator=g).tolist()):
        offs = torch.tensor(counts).cumsum(0).int()
        ref = deepgemm.layout(offs, sum(counts))
        lay = deepgemm.layout(offs.cuda(), sum(counts))
        assert torch.equal(lay.rows.cpu(), ref.rows) and torch.equal(lay.m_indices.cpu(), ref.m_indices)
