"""DeepGEMM glue on the CPU: the loader without deep_gemm, the padded contiguous layout made on the
device, the autograd function on `deepgemm.REFERENCE` (the same maths in PyTorch) against the Triton
path's reference and against plain products, the in-place weight gradient, and the policy that
picks DeepGEMM. The GEMMs themselves: tests/test_deepgemm_gpu.py."""

import sys

import pytest
import torch
import torch.nn.functional as F
from run_path import one_gpu_kernels

from pithtrain import kernels
from pithtrain.config import load_config
from pithtrain.kernels import deepgemm, fp8_linear
from pithtrain.models import build_model
from pithtrain.models.common import attention_kernels


def test_load_returns_none_with_a_reason_when_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import deep_gemm -> ImportError
    why = []
    assert deepgemm.load(why) is None
    assert why and "deep_gemm" in why[-1]


def _offs(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


@pytest.mark.quick
def test_layout_starts_each_group_on_a_multiple_of_128_rows():
    counts = [3, 0, 128, 129, 1]
    lay = deepgemm.layout(_offs(counts), sum(counts))
    # The bound, not the exact size: no host read of the counts (M + G * 127, rounded up).
    assert len(lay.m_indices) == deepgemm.padded_rows(261, 5) == 896
    want_m, want_rows, start = [], [], 0
    for g, c in enumerate(counts):
        k = -(-c // 128) * 128
        want_m += [g] * c + [-1] * (k - c)
        want_rows += list(range(start, start + c))
        start += k
    want_m += [-1] * (896 - len(want_m))  # whole tiles past the last group: -1, skipped by DeepGEMM
    assert lay.m_indices.tolist() == want_m and lay.rows.tolist() == want_rows
    x = torch.randn(sum(counts), 4)
    padded = x.new_zeros(896, 4).index_copy_(0, lay.rows, x)
    assert torch.equal(deepgemm.unpad(padded, lay), x)


def test_layout_with_no_rows_and_with_one_group():
    lay = deepgemm.layout(torch.zeros(3, dtype=torch.int32), 0)
    assert len(lay.m_indices) == 0 and len(lay.rows) == 0
    lay = deepgemm.layout(_offs([300]), 300)
    assert lay.rows.tolist() == list(range(300)) and lay.m_indices[:300].eq(0).all()
    assert len(lay.m_indices) == 512 and lay.m_indices[300:].eq(-1).all()


def _case(counts=(5, 200, 0, 64, 131), K=256, N=384, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), K, generator=g)
    w = torch.nn.Parameter(torch.randn(len(counts), K, N, generator=g) / K ** 0.5)
    return x.requires_grad_(), w, _offs(counts)


def test_reference_gemms_match_the_triton_paths_reference_and_plain_products():
    """The same quantisation as fp8_linear's reference, so the same numbers up to summation order;
    within e4m3's error of the unquantised products; the weight gradient is the plain one."""
    x, w, offs = _case()
    y = deepgemm.FP8GroupedMM()(x, w, offs)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    y2 = fp8_linear.FP8GroupedMM()(x, w, offs)
    dx2, dw2 = torch.autograd.grad(y2, (x, w), dy)
    torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dx2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, dw2)
    y_ref = F.grouped_mm(x, w, offs=offs)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), dy)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(y, y_ref) < 2 ** -4 and rel(dx, dx_ref) < 2 ** -4 and rel(y, y_ref) > 1e-3  # FP8 really ran
    torch.testing.assert_close(dw, dw_ref)
    assert (dw[2] == 0).all()  # the empty group


def test_weight_gradient_accumulates_in_place_over_micro_batches():
    """in_place: the first backward leaves the gradient to autograd (p.grad is its tensor), the
    second adds into p.grad itself (the witness counts it); the sum equals plain autograd's. An
    input-only backward (the pipeline's B pass) writes no weight gradient."""
    mm = deepgemm.FP8GroupedMM(in_place=True)
    x1, w, offs = _case(seed=1)
    x2 = torch.randn_like(x1).requires_grad_()
    ref = deepgemm.FP8GroupedMM()
    want = torch.zeros_like(w)
    for x in (x1, x2):
        y = ref(x, w, offs)
        want += torch.autograd.grad(y, w, torch.ones_like(y))[0]
        mm(x, w, offs).sum().backward()
    torch.testing.assert_close(w.grad, want)
    assert getattr(w, "wgrad_adds", 0) == 1
    before = w.grad.clone()
    y = mm(x1, w, offs)
    (dx,) = torch.autograd.grad(y.sum(), x1)
    assert torch.equal(w.grad, before) and dx.shape == x1.shape and getattr(w, "wgrad_adds", 0) == 1


def test_configure_picks_deepgemm_for_fp8_on_hopper_and_keeps_in_place_gradients(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "HAVE_TRITON", True)
    monkeypatch.setattr(kernels, "_deepgemm", lambda: True)
    cap = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap[0])
    on = one_gpu_kernels("auto", "cuda", fp8=True)
    assert on["fp8"] and on["deepgemm"] and on["wgrad"]
    triton_fp8 = one_gpu_kernels("auto", "cuda", fp8=True, off=("deepgemm",))  # the bench's no-deepgemm
    assert triton_fp8["fp8"] and not triton_fp8["deepgemm"] and not triton_fp8["wgrad"]
    no_fp8 = one_gpu_kernels("auto", "cuda", fp8=True, off=("fp8",))  # the bench's no-fp8: nothing FP8 runs
    assert not no_fp8["fp8"] and not no_fp8["deepgemm"] and no_fp8["wgrad"]
    bf16 = one_gpu_kernels("auto", "cuda")
    assert not bf16["deepgemm"] and bf16["wgrad"]
    assert not one_gpu_kernels("auto", "cuda", fp8=True, fsdp=True)["wgrad"]
    cap[0] = (10, 0)  # Blackwell: DeepGEMM's path there is untested, so Triton
    assert not one_gpu_kernels("auto", "cuda", fp8=True)["deepgemm"]
    cap[0] = (9, 0)
    monkeypatch.setattr(kernels, "_deepgemm", lambda: False)  # not installed
    assert not one_gpu_kernels("auto", "cuda", fp8=True)["deepgemm"]
    line = kernels.describe(on, attention_kernels(build_model(load_config(None).model, init=False), on))
    assert "deepgemm" in line and "fused" in line


def test_use_kernels_gives_each_experts_module_its_own_deepgemm_mm(monkeypatch):
    from pithtrain.models.common import GroupedExperts, use_kernels
    from pithtrain.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

    monkeypatch.setattr(deepgemm, "load", lambda why=None: None)  # CPU: the reference ops
    torch.manual_seed(1)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, moe_intermediate_size=24, num_experts=4, top_k=2)
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights()
    use = {**one_gpu_kernels("auto", "cpu", fp8=True), "deepgemm": True, "wgrad": True}
    model = use_kernels(model, use)
    mms = [m.mm for m in model.modules() if isinstance(m, GroupedExperts)]
    assert len(mms) == 2 and all(isinstance(mm, deepgemm.FP8GroupedMM) and mm.in_place for mm in mms)
    assert mms[0] is not mms[1] and mms[0].cache is not mms[1].cache
    ids = torch.randint(0, 64, (2, 16))
    for _ in range(2):  # two micro-batches: the second adds its expert gradients in place
        model(ids, labels_BS=ids).backward()
    assert fp8_linear.quantised(model) == 2 * 2
    # The experts' own in-place adds (the embedding and LM head count theirs separately): each of
    # the 2 x 2 expert weights, once, on the second micro-batch.
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert sum(getattr(p, "wgrad_adds", 0) for m in experts for p in m.parameters()) == 4


def test_the_layer_reuses_its_layout_until_the_offsets_change():
    mm = deepgemm.FP8GroupedMM()
    offs = _offs([5, 200, 0])
    first = mm.layout(offs, 205)
    assert mm.layout(offs, 205) is first  # the layer's second GEMM
    offs.copy_(_offs([100, 5, 100]))  # the same tensor written in place: not the same rows
    again = mm.layout(offs, 205)
    assert again is not first and again.rows.tolist() == deepgemm.layout(offs, 205).rows.tolist()
