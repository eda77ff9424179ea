"""DeepGEMM glue on the CPU: the loader without deep_gemm, the padded contiguous layout and the
k-grouped operand packing against plain PyTorch (the GEMMs themselves: tests/test_deepgemm_gpu.py)."""

import sys

import torch

from pithtrain.kernels import deepgemm, fp8_linear


def test_load_returns_none_with_a_reason_when_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import deep_gemm -> ImportError
    why = []
    assert deepgemm.load(why) is None
    assert why and "deep_gemm" in why[-1]


def _offs(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def test_plan_pads_each_group_to_128_rows():
    counts = [3, 0, 128, 129, 1]
    p = deepgemm.plan(_offs(counts), sum(counts))
    assert p.ks == [128, 0, 128, 256, 128] and p.ks_tensor.tolist() == p.ks
    want_m, want_rows, start = [], [], 0
    for g, (c, k) in enumerate(zip(counts, p.ks)):
        want_m += [g] * c + [-1] * (k - c)
        want_rows += list(range(start, start + c))
        start += k
    assert p.m_indices.tolist() == want_m and p.rows.tolist() == want_rows
    tiles = [(s, k) for s, k in zip([0, 128, 128, 256, 512], p.ks) for _ in range(k // 128)]
    assert list(zip(p.tile_start.tolist(), p.tile_len.tolist())) == tiles


def test_pad_unpad_round_trip_and_zero_padding():
    counts = [5, 200, 0, 64]
    x = torch.randn(sum(counts), 8)
    p = deepgemm.plan(_offs(counts), len(x))
    xp = deepgemm.pad(x, p)
    assert xp.shape == (len(p.m_indices), 8) and torch.equal(deepgemm.unpad(xp, p), x)
    assert (xp[p.m_indices == -1] == 0).all()
    # A grouped product through the padded layout equals the per-group reference.
    w = torch.randn(len(counts), 8, 3)
    y = torch.zeros(len(p.m_indices), 3)
    for g in range(len(counts)):
        y[p.m_indices == g] = xp[p.m_indices == g] @ w[g]
    ref = torch.cat([xg @ w[g] for g, xg in enumerate(x.split(counts))])
    torch.testing.assert_close(deepgemm.unpad(y, p), ref)


def test_plan_with_no_rows():
    p = deepgemm.plan(torch.zeros(3, dtype=torch.int32), 0)
    assert p.ks == [0, 0, 0] and len(p.m_indices) == 0 and len(p.rows) == 0


def test_k_grouped_packing_matches_the_per_group_transpose():
    counts = [130, 7, 0, 128]
    x = torch.randn(sum(counts), 256)
    p = deepgemm.plan(_offs(counts), len(x))
    xp = deepgemm.pad(x, p)
    q, s = deepgemm.quant_tokens_reference(xp, p, transpose=False)
    assert q.shape == xp.shape and s.shape == (len(xp) // 128, 256)
    deq = q.float() * s.repeat_interleave(128, 0)
    torch.testing.assert_close(deq, xp, rtol=0.07, atol=0.02)  # e4m3: 3 mantissa bits, subnormals
    # Scales along the tokens are fp8_linear's 1x128 scales of the transposed matrix.
    q_ref, s_ref = fp8_linear.quant_rows(xp.t())
    assert torch.equal(q.t().float(), q_ref.float()) and torch.equal(s, s_ref)
    flat, s2 = deepgemm.quant_tokens_reference(xp, p, transpose=True)
    assert torch.equal(s2, s) and flat.numel() == xp.numel()
    start = 0
    for k in p.ks:  # group g's block: (D, k) row-major at start * D
        block = flat[start * 256:(start + k) * 256].view(256, k)
        assert torch.equal(block.float(), q[start:start + k].t().float())
        start += k
