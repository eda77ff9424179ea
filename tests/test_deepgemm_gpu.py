"""DeepGEMM's FP8 expert GEMMs on the GPU (lent H200: scripts/device22.sh runs
`pytest -m gpu tests/test_deepgemm_gpu.py` after building DeepGEMM).

At each bench family's expert shapes (all experts, ~64 rows each, a few empty), against bf16
grouped_mm / per-group bf16 products: forward, data grad and weight grad within 2^-4 = 6.25%
relative (tests/test_fp8_gpu.py's bound for the Triton FP8 path); forward and data grad against the
Triton FP8 kernels on the same quantisation within 1e-2; the bf16 wrapper within bf16 rounding."""

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


def _case(name, which, rows=64):
    E, D, F_ = SHAPES[name]
    K, N = (D, 2 * F_) if which == "w13" else (F_, D)
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.randint(0, 2 * rows, (E,), generator=g, device="cuda")
    counts[::7] = 0
    offs = counts.cumsum(0).int()
    x = torch.randn(int(offs[-1]), K, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(E, K, N, device="cuda", generator=g) / K ** 0.5).bfloat16().requires_grad_()
    return x.requires_grad_(), w, offs


@need_dg
@pytest.mark.parametrize("name,which", CASES)
def test_fp8_forward_dgrad_wgrad_against_bf16(name, which):
    x, w, offs = _case(name, which)
    y = deepgemm.FP8GroupedMM(DG)(x, w, offs)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    y_ref = F.grouped_mm(x, w, offs=offs)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), dy)
    assert rel(y, y_ref) < 2 ** -4 and rel(dx, dx_ref) < 2 ** -4 and rel(dw, dw_ref) < 2 ** -4
    nonempty = torch.diff(offs, prepend=offs.new_zeros(1)) > 0
    assert (dw[~nonempty] == 0).all()  # empty experts get no gradient
    # Same operands as pithtrain's Triton FP8 path: only accumulation order differs.
    wq, wqt, ws = tk.quant_blocks(w.detach())
    y_tk = tk.mgrouped_mm(*tk.quant_rows(x.detach()), wqt, ws, offs)
    dx_tk = tk.mgrouped_mm(*tk.quant_rows(dy), wq, ws.transpose(1, 2), offs)
    assert rel(y, y_tk) < 1e-2 and rel(dx, dx_tk) < 1e-2


@need_dg
def test_k_grouped_packing_kernel_matches_the_reference():
    x, _, offs = _case("qwen3-30b-a3b", "w2")
    p = deepgemm.plan(offs, len(x))
    xp = deepgemm.pad(x.detach(), p)
    for transpose in (False, True):
        q, s = tk.quant_tokens(xp, p.tile_start, p.tile_len, transpose=transpose)
        q_ref, s_ref = deepgemm.quant_tokens_reference(xp, p, transpose=transpose)
        torch.testing.assert_close(s, s_ref.cuda(), rtol=1e-6, atol=0)
        assert (q.float() - q_ref.float()).abs().max() <= 32  # one e4m3 step at most (ties)


@need_dg
@pytest.mark.parametrize("name", list(SHAPES))
def test_bf16_mgrouped_against_grouped_mm(name):
    x, w, offs = _case(name, "w13")
    y = deepgemm.mgrouped_bf16(DG, x.detach(), w.detach().transpose(1, 2).contiguous(), offs)
    assert rel(y, F.grouped_mm(x.detach(), w.detach(), offs=offs)) < 1e-2
