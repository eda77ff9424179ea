"""GPU kernels against their references (run on the lent H200: `pytest -m gpu tests/test_kernels_gpu.py`).

Error measure: ||out - ref|| / ||ref|| against a float64 (or fp32) reference on the same fresh
random inputs; bf16 operands land between 1e-3 and 1e-2, so bf16 checks use 2e-2."""

import functools

import pytest
import torch
from run_path import one_gpu_kernels

from pithtrain.kernels import fa4
from pithtrain.models import common

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def rel(a, b):
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def grads_of(fn, *xs):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    out = fn(*xs)
    g = torch.randn_like(out)
    out.backward(g)
    return out.detach(), [x.grad for x in xs], g


@pytest.mark.parametrize("clamped", [False, True])
def test_swiglu_triton_matches_reference(clamped):
    from pithtrain.kernels.swiglu import swiglu

    for X, F in [(4099, 768), (1000, 1408), (513, 2880)]:
        h = 4 * torch.randn(X, 2 * F, device="cuda", dtype=torch.bfloat16)  # clamp at 7 is active
        alpha, limit = (1.702, 7.0) if clamped else (None, None)
        ref = lambda t: common.swiglu(t.double(), alpha, limit)  # noqa: E731
        x = h.detach().clone().requires_grad_()
        out = swiglu(x, alpha, limit)
        g = torch.randn_like(out)
        out.backward(g)
        xr = h.double().requires_grad_()
        outr = ref(xr)
        outr.backward(g.double())
        assert rel(out, outr) < 1e-2 and rel(x.grad, xr.grad) < 1e-2, (X, F)


def test_permute_unpermute_match_index_add_reference():
    """LocalDispatcher with the Triton gathers vs its own index / index_add path in float64."""
    T, D, E, A = 4096, 2048, 64, 6
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E, device="cuda")[:A] for _ in range(T)])
    w = torch.rand(T, A, device="cuda", dtype=torch.bfloat16)
    disp = common.LocalDispatcher()
    disp.fused = True

    def through_dispatcher(x, w):
        x_XD, w_d, _, info = disp.dispatch(x, idx, w, E)
        return disp.combine(x_XD * 1.5, w_d, info)

    out, (gx, gw), g = grads_of(through_dispatcher, x, w)
    disp.fused = False
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    outr = through_dispatcher(xr, wr)
    outr.backward(g.double())
    assert rel(out, outr) < 1e-2 and rel(gx, xr.grad) < 1e-2 and rel(gw, wr.grad) < 1e-2


def test_linear_cross_entropy_matches_checkpointed_reference():
    from pithtrain.kernels.linear_ce import linear_cross_entropy_sum

    T, D, V = 5000, 1024, 32000
    h = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w = 0.02 * torch.randn(V, D, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, V, (T,), device="cuda")
    labels[::7] = -100
    out, (gh, gw), g = grads_of(lambda a, b: linear_cross_entropy_sum(a, b, labels, 2048), h, w)
    hr, wr = h.float().requires_grad_(), w.float().requires_grad_()
    ref = common._ce_chunk(hr, wr, labels)
    ref.backward(g.float())
    assert rel(out, ref) < 1e-3 and rel(gh, hr.grad) < 2e-2 and rel(gw, wr.grad) < 2e-2


def test_expert_bias_matches_index_reference():
    from pithtrain.kernels.expert_bias import expert_bias_add

    E, N = 32, 5760
    counts = torch.randint(0, 400, (E,), device="cuda")
    counts[3] = 0  # an expert with no rows
    X = int(counts.sum())
    offs = torch.cumsum(counts, 0)
    expert = torch.repeat_interleave(torch.arange(E, device="cuda"), counts, output_size=X)
    h = torch.randn(X, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(E, N, device="cuda", dtype=torch.bfloat16)
    out, (gh, gb), g = grads_of(lambda h, b: expert_bias_add(h, b, expert, offs), h, b)
    hr, br = h.double().requires_grad_(), b.double().requires_grad_()
    outr = hr + br[expert]
    outr.backward(g.double())
    assert rel(out, outr) < 1e-2 and rel(gh, hr.grad) < 1e-2 and rel(gb, br.grad) < 1e-2
    assert gb[3].abs().sum() == 0


@pytest.mark.parametrize("window, sinks, gqa", [(None, True, True), (128, True, True), (128, False, False)])
def test_flex_attention_matches_eager(window, sinks, gqa):
    from pithtrain.kernels.flex import FlexAttention

    B, H, S, d = 2, 8, 512, 64
    K = 2 if gqa else H
    q = torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, K, S, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, K, S, d, device="cuda", dtype=torch.bfloat16)
    s = torch.randn(H, device="cuda", dtype=torch.float32) if sinks else None
    scale = d ** -0.5
    args = (q, k, v) + ((s,) if sinks else ())

    def fused(q, k, v, s=None):
        return FlexAttention([window])(q, k, v, scale=scale, window=window, sinks_H=s)

    def ref(q, k, v, s=None):
        return common.eager_attention(q, k, v, scale=scale, window=window, sinks_H=s)

    out, grads, g = grads_of(fused, *args)
    xr = [a.double().requires_grad_() for a in args]
    outr = ref(*xr)
    outr.backward(g.double())
    assert rel(out, outr) < 2e-2
    for a, b in zip(grads, xr):
        assert rel(a, b.grad) < 2e-2


def test_cudnn_sdpa_path_matches_eager():
    B, H, K, S, d = 2, 32, 4, 1024, 128
    q = torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, K, S, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, K, S, d, device="cuda", dtype=torch.bfloat16)
    out, grads, g = grads_of(lambda q, k, v: common.attention(q, k, v, scale=d ** -0.5,
                                                              sdpa_first=common.SDPA_CUDNN_FIRST), q, k, v)
    xr = [a.double().requires_grad_() for a in (q, k, v)]
    outr = common.eager_attention(*xr, scale=d ** -0.5)
    outr.backward(g.double())
    assert rel(out, outr) < 2e-2
    for a, b in zip(grads, xr):
        assert rel(a, b.grad) < 2e-2


THREE = [[100, 601, 323], [1024]]  # row 0: the first shorter than the window, the last no tile multiple
MANY = [[1 + i % 5 for i in range(340)] + [4], [1024]]  # 341 documents: FA4's binary batch search (> 256)
SHAPES = list(fa4.TESTED)  # the shapes the kernel choice lets flash-attn-4 run (fa4.covers)


@pytest.mark.parametrize("H, K, d, e, window, sinks, lengths",
                         [(*shape, None) for shape in SHAPES] + [(*shape, THREE) for shape in SHAPES]
                         + [(*SHAPES[0], MANY), (*SHAPES[3], MANY)])
def test_flash_attn_4_matches_eager(H, K, d, e, window, sinks, lengths, monkeypatch):
    """common.attention's flash-attn-4 path (kernels/fa4.py) at each family's head shape, forward
    and every gradient (the sinks' included) against the float64 eager reference; with documents
    (`lengths`, per row) on the package's varlen interface, a few and many (past its 256-sequence
    switch of scheduler), against the reference's document mask, and the package's ops did run."""
    if not fa4.HAVE_FA4:
        pytest.skip("flash-attn-4 is not installed")
    B, S = 2, 1024
    docs = cu = None
    if lengths is not None:
        assert all(sum(row) == S for row in lengths)
        docs = torch.tensor([sum([[i] * n for i, n in enumerate(row)], []) for row in lengths], device="cuda")
        cu = common.document_starts(docs)
        n = sum(len(row) for row in lengths)
        assert cu.shape == (n + 1,) and cu[-1].item() == B * S and cu[len(lengths[0])].item() == S
    calls = []
    for op in ("fa4_fwd", "fa4_bwd"):
        real = getattr(fa4, op)
        monkeypatch.setattr(fa4, op, lambda *a, real=real, op=op: calls.append(
            (op, a[-2] if a[-2] is None else a[-2].tolist())) or real(*a))
    q = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # as the models make them
    k = torch.randn(B, S, K, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(B, S, K, e, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    s = torch.randn(H, device="cuda", dtype=torch.bfloat16) if sinks else None
    args = (q, k, v) + ((s,) if sinks else ())
    scale = d ** -0.5

    def fused(q, k, v, s=None):
        return common.attention(q, k, v, scale=scale, window=window, sinks_H=s, fa4=True,
                                docs=None if docs is None else common.Documents(docs, None, cu))

    out, grads, g = grads_of(fused, *args)
    assert out.shape == (B, H, S, e)
    starts = None if cu is None else cu.tolist()
    assert calls == [("fa4_fwd", starts), ("fa4_bwd", starts)]  # the starts (or None) reached both ops
    xr = [a.double().requires_grad_() for a in args]
    outr = common.eager_attention(*xr[:3], scale=scale, window=window, sinks_H=xr[3] if sinks else None,
                                  docs_BS=docs)
    outr.backward(g.double())
    assert rel(out, outr) < 2e-2
    for a, b in zip(grads, xr, strict=True):
        assert a is not None and rel(a, b.grad) < 2e-2


def test_the_kernel_choice_on_this_gpu_runs_flash_attn_4_where_its_tests_cover():
    """The real device facts (nothing faked): every layer of each published family is bound to
    flash-attn-4, and a head width no test covers (96) keeps cuDNN SDPA (kernels/fa4.py covers)."""
    from pithtrain.config import load_config
    from pithtrain.models import build_model

    if not fa4.HAVE_FA4:
        pytest.skip("flash-attn-4 is not installed")
    use = one_gpu_kernels("auto", "cuda")
    for name in ("qwen3-30b-a3b", "deepseek-v2-lite", "gpt-oss-20b"):
        m = load_config(name).model
        kinds = common.attention_kernels(common.use_kernels(build_model(m, init=False), use), use)
        assert kinds == {i: "flash-attn-4" for i in range(m.num_layers)}, name
    m = load_config("qwen3-30b-a3b", ["model.head_dim=96"]).model
    kinds = common.attention_kernels(common.use_kernels(build_model(m, init=False), use), use)
    assert set(kinds.values()) == {"cuDNN SDPA/FlexAttention (d_qk 96, d_v 96: not a shape flash-attn-4 is tested "
                                   "at, kernels/fa4.py)"}


def small_model(family):
    import dataclasses

    from pithtrain.models import FAMILIES

    cfg_cls, model_cls = FAMILIES[family][0], FAMILIES[family][1]
    small = {"vocab_size": 1000, "hidden_size": 256, "num_layers": 2, "num_heads": 4,
             "num_kv_heads": 2, "head_dim": 64, "moe_intermediate_size": 128, "intermediate_size": 256,
             "num_experts": 8, "top_k": 2, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
             "qk_rope_head_dim": 32, "v_head_dim": 64, "sliding_window": 128, "n_shared_experts": 1,
             "first_k_dense_replace": 1}
    names = {f.name for f in dataclasses.fields(cfg_cls)}
    cfg = cfg_cls(**{k: v for k, v in small.items() if k in names})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = model_cls(cfg)
    model.init_weights()
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "gpt_oss"])
def test_model_step_has_no_host_synchronisation(family):
    """Forward and backward of a micro-batch with the fused operators (what train.py runs between
    optimizer steps) never waits for the GPU: a host sync drains the queue and leaves the GPU idle
    while the CPU launches the next kernels (torch.bincount did, twice per MoE layer). The first
    call, which makes masks and tunes kernels, runs outside the check; the checked ones add into
    its gradients (bf16 parameters: kernels/wgrad.py's in-place expert weight gradient). Eager,
    then compiled as train.py runs it."""
    from pithtrain.models.common import use_kernels

    model = small_model(family)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    use_kernels(model, one_gpu_kernels("auto", "cuda"))
    x = torch.randint(0, 1000, (2, 512), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, labels_BS=x)
        loss.backward()

    from pithtrain.compile import apply_compile

    for compiled in (False, True):  # eager, then as train.py runs it (the dispatch plan compiled too)
        if compiled:
            torch._dynamo.reset()
            apply_compile(model)
        step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "gpt_oss"])
def test_fused_and_compiled_model_matches_reference_model(family):
    """A small model at bf16: all fused operators + torch.compile vs PyTorch references, eager."""
    from pithtrain.compile import apply_compile
    from pithtrain.models.common import use_kernels

    model = small_model(family)
    x = torch.randint(0, 1000, (2, 512), device="cuda")
    y = torch.randint(0, 1000, (2, 512), device="cuda")

    def run(autocast=True):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, labels_BS=y)
        loss.backward()
        return loss.detach().float(), torch.cat([p.grad.flatten().float()
                                                 for p in model.parameters() if p.grad is not None])

    # bf16 noise is the yardstick: the fused + compiled model must be as close to an fp32 run as
    # the bf16 reference model is
    use_kernels(model, one_gpu_kernels("torch", "cuda"))
    exact_loss, exact_g = run(autocast=False)
    ref_loss, ref_g = run()
    use_kernels(model, one_gpu_kernels("auto", "cuda"))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    apply_compile(model)
    loss, g = run()
    loss2, g2 = run()  # second call: compiled graphs reused
    assert counters["stats"]["unique_graphs"] >= 3, dict(counters["stats"])  # compiled for real
    torch._dynamo.reset()
    ref_err = rel(ref_g, exact_g)
    loss_tol = 2 * abs(ref_loss.item() - exact_loss.item()) / exact_loss.item() + 1e-3
    assert abs(loss.item() - exact_loss.item()) / exact_loss.item() < loss_tol
    assert rel(g, exact_g) < 1.5 * ref_err + 1e-3 and rel(g2, exact_g) < 1.5 * ref_err + 1e-3, ref_err


@pytest.mark.parametrize("dtype,betas", [(torch.float32, (0.9, 0.95)), (torch.float32, (0.9, 0.999)),
                                         (torch.bfloat16, (0.9, 0.95))])
def test_triton_adamw_matches_torch_fused_adamw(dtype, betas):
    check_triton_adamw("cuda", dtype, betas)


def test_triton_adamw_writes_the_next_steps_bf16_weights():
    """kernels/adamw.py on float32 masters with bf16 copies (precision.WeightCopies): the copy after
    the step is the new master rounded to bf16, bit for bit, and the next step's swap takes it
    without a cast (a copy overwritten behind its back stays so); an in-place change to the master
    through torch afterwards makes the swap cast again."""
    from pithtrain.kernels.adamw import AdamW
    from pithtrain.precision import WeightCopies

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4099, 64), torch.nn.Linear(64, 3)).cuda()
    copies = WeightCopies("all")
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, copies=copies)
    x = torch.randn(8, 4099, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        with copies.swap(model):
            model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    for p in model.parameters():
        assert torch.equal(copies.copy_of(p), p.detach().to(torch.bfloat16))
        copies.copy_of(p).detach().fill_(7)  # reused as it is: no cast on entry
    with copies.swap(model):
        assert all((w == 7).all() for w in model.parameters())
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    with copies.swap(model):
        assert torch.equal(model[0].weight, copies.master(model[0].weight).detach().to(torch.bfloat16))
        assert (model[1].weight == 7).all()


def test_triton_lean_adamw_is_the_float32_pass_on_the_joined_master():
    """kernels/adamw.py on the lean state (train.state=lean): each step its joined master is, bit for
    bit, what the float32 pass makes of the same master, gradient and (bf16, upcast) moments, and its
    moments that result rounded to bf16; sizes not multiples of the block, weight decay 0.1 and 0, a
    clip factor. Off the GPU the same step is lean_update_ (tests/test_lean.py)."""
    import copy

    from pithtrain.kernels.adamw import AdamW, join
    from pithtrain.precision import LeanState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4099, 64), torch.nn.Linear(64, 3)).cuda()
    ref = copy.deepcopy(model)
    lean = LeanState(accumulate=False)
    lean.convert(model)

    def groups(m):
        return [{"params": [p for p in m.parameters() if p.ndim == 2], "weight_decay": 0.1},
                {"params": [p for p in m.parameters() if p.ndim == 1], "weight_decay": 0.0}]
    opt, ref_opt = AdamW(groups(model), lr=1e-2, lean=lean), AdamW(groups(ref), lr=1e-2)
    for step in range(4):
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.float()
            if step:
                for k in ("exp_avg", "exp_avg_sq"):
                    ref_opt.state[q][k].copy_(opt.state[p][k])
        opt.step(grad_scale=0.5 if step == 2 else 1.0)
        ref_opt.step(grad_scale=0.5 if step == 2 else 1.0)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.dtype == torch.bfloat16
            assert torch.equal(join(p.detach(), lean.lo(p)).view(torch.int32), q.detach().view(torch.int32))
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][k], ref_opt.state[q][k].to(torch.bfloat16))


def check_triton_adamw(device, dtype, betas):
    """kernels/adamw.py against torch.optim.AdamW(fused=True): five steps with changing gradients
    and learning rate, two weight-decay groups (0.1 and 0), sizes not multiples of the block, a
    non-contiguous parameter (torch's kernel takes it), p, exp_avg and exp_avg_sq compared; after
    step 3 a fresh optimizer of each kind resumes from the other's state dict (checkpoints
    interchange); steps 2 and 4 take a clip factor (grad_scale) that torch's gets premultiplied; a
    parameter without a gradient is left alone; build_optimizer wires it by `use`."""
    from pithtrain.kernels.adamw import AdamW

    torch.manual_seed(0)
    shapes = [(100003,), (64, 4099), (3, 256, 1536), (7,)]
    ours = [torch.randn(s, device=device).to(dtype) for s in shapes] + [torch.randn(33, 64, device=device).t()]
    ref = [p.clone() if p.is_contiguous() else p.t().clone().t() for p in ours]
    assert not ours[-1].is_contiguous() and not ref[-1].is_contiguous()

    def groups(ps):
        return [{"params": ps[1:3] + ps[4:], "weight_decay": 0.1}, {"params": [ps[0], ps[3]], "weight_decay": 0.0}]

    kw = dict(lr=1e-2, betas=betas, eps=1e-8)
    opt, ref_opt = AdamW(groups(ours), **kw), torch.optim.AdamW(groups(ref), fused=True, **kw)

    def step(o, ps, gs, lr, scale):  # ours takes the clip's factor, torch's gets scaled gradients
        for p, g in zip(ps, gs):
            p.grad = g.clone() if g.is_contiguous() else g.t().clone().t()
            if o is ref_opt:
                p.grad.mul_(scale)
        for group in o.param_groups:
            group["lr"] = lr
        o.step(grad_scale=scale) if o is opt else o.step()

    def close(a, b):  # fp32: the same to rounding (the formula); bf16: the state is stored rounded,
        # so a rounding flip in one step carries into the next, and a moment near zero (cancellation)
        # keeps its neighbours' absolute error: a few rounding steps of the tensor's typical size
        # apart, and as close as bf16's unit roundoff overall (a GPU check: Triton's CPU interpreter
        # truncates to bf16)
        if dtype == torch.float32:  # (values are O(1): 1e-6 absolute covers results near zero)
            return rel(a, b) < 2e-6
        a, b = a.double(), b.double()
        ulps = (a - b).abs() / (torch.finfo(dtype).eps * (b.abs() + b.pow(2).mean().sqrt()))
        print(f"bf16 AdamW: max {ulps.max().item():.2f} rounding steps, rel {rel(a, b):.1e}")
        return ulps.max().item() <= 4 and rel(a, b) < 4e-3

    for i, lr in enumerate([1e-2, 5e-3, 1e-3, 2e-3, 1e-3]):
        gs = [torch.randn_like(p) for p in ours]
        scale = 0.5 if i % 2 else 1.0  # a power of two: the same scaled gradient in both dtypes
        step(opt, ours, gs, lr, scale)
        step(ref_opt, ref, gs, lr, scale)
        assert torch.equal(ours[1].grad, gs[1])  # the clip's factor is not written into the gradient
        for a, b in zip(ours, ref):
            assert close(a, b), (i, a.shape, rel(a, b))
            sa, sb = opt.state[a], ref_opt.state[b]
            assert sa["step"].device == a.device and float(sa["step"]) == float(sb["step"]) == i + 1
            assert close(sa["exp_avg"], sb["exp_avg"]) and close(sa["exp_avg_sq"], sb["exp_avg_sq"]), (i, a.shape)
        if i == 2:  # each resumes from the other's checkpoint
            sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
            opt, ref_opt = AdamW(groups(ours), **kw), torch.optim.AdamW(groups(ref), fused=True, **kw)
            opt.load_state_dict(ref_sd)
            ref_opt.load_state_dict(sd)
    ours[0].grad = None  # a parameter without a gradient is left alone
    before = ours[0].clone()
    opt.step()
    assert torch.equal(ours[0], before)

    from pithtrain.bench import bench_config
    from pithtrain.build import build_optimizer

    cfg = bench_config("default", 1, 1, 16)
    model = torch.nn.Linear(4, 4, device=device)
    assert type(build_optimizer(model, cfg, torch.device(device), {"adamw": True})) is AdamW
    assert type(build_optimizer(model, cfg, torch.device(device), {"adamw": False})) is torch.optim.AdamW


@pytest.mark.parametrize("E,D,N,rows", [(8, 256, 384, 3000), (128, 768, 2048, 65536), (32, 2880, 5760, 32768)])
@pytest.mark.parametrize("target,add", [(torch.bfloat16, True), (torch.float32, True), (torch.float32, False)])
def test_wgrad_kernel_adds_into_the_gradient(E, D, N, rows, target, add):
    """kernels/wgrad_triton.add_kgrouped: grad[e] += x[rows of e]^T dy[rows of e] against float64, on uneven
    groups with an empty one and unaligned starts; the expert shapes of the three families (Qwen3
    w2, GPT-OSS w13) and a small one; bf16 and float32 gradients; add=False (a float32 master's
    first micro-batch) writes the product over a gradient full of NaN, zeros for the empty expert."""
    from pithtrain.kernels.wgrad_triton import add_kgrouped

    torch.manual_seed(0)
    counts = torch.randint(0, 2 * rows // E, (E,))
    counts[1] = 0
    offs = counts.cumsum(0).to(torch.int32).cuda()
    X = int(counts.sum())
    x = torch.randn(X, D, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(X, N, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(E, D, N, device="cuda").to(target) if add else torch.full((E, D, N), float("nan"), device="cuda")
    base = g.double() if add else torch.zeros_like(g, dtype=torch.float64)
    want = base + torch.nn.functional.grouped_mm(x.t(), dy, offs=offs).double()  # bf16 out, fp32 acc
    exact = base.clone()
    start = 0
    for e, end in enumerate(offs.tolist()):
        exact[e] += x[start:end].double().t() @ dy[start:end].double()
        start = end
    before = g.clone()
    add_kgrouped(g, x, dy, offs, add=add)
    if add:
        assert torch.equal(g[1], before[1])  # the empty expert is left as it was
    else:
        assert not g[1].any() and not g.isnan().any()
    if target == torch.float32:  # products added in float32: no bf16 rounding of dw on the way
        assert rel(g, exact) < 1e-5 < rel(want, exact), (rel(g, exact), rel(want, exact))
    else:  # one rounding to bf16 at the end, at least as close as torch's GEMM and add
        assert rel(g, exact) <= 1.2 * rel(want, exact) + 1e-6


def test_embedding_gradient_in_place_is_exact_and_deterministic():
    """kernels/wgrad.embedding at Qwen3's vocabulary and width, a micro-batch of 8192 tokens of which
    a fifth are one token: the rows added into a float32 gradient equal float64 sums of the bf16
    rows (index_put_ with accumulate), bit for bit the same on a second run, and autograd.grad
    returns F.embedding's gradient."""
    from pithtrain.kernels import wgrad
    from pithtrain.precision import WeightCopies

    torch.manual_seed(0)
    V, D, T = 151936, 2048, 8192
    ids = torch.randint(0, V, (2, T // 2), device="cuda")
    ids.view(-1)[::5] = 11
    dys = [torch.randn(2, T // 2, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    exact = torch.zeros(V, D, device="cuda", dtype=torch.float64)
    for dy in dys:
        exact.index_add_(0, ids.flatten(), dy.flatten(0, 1).double())
    runs = []
    for _ in range(2):
        master = torch.nn.Parameter(torch.zeros(V, D, device="cuda"))
        copies, holder = WeightCopies("all"), torch.nn.Module()
        holder.w = master
        with copies.swap(holder):  # the bf16 copy, linked to its master as a step's is
            w = holder.w
        for dy in dys:
            wgrad.embedding(ids, w, copies).backward(dy)
        assert w.grad is None and master.wgrad_adds == 2  # the first micro-batch wrote the master too
        runs.append(master.grad)
    assert torch.equal(runs[0], runs[1])
    assert rel(runs[0], exact) < 1e-6
    (got,) = torch.autograd.grad(wgrad.embedding(ids, w), [w], dys[0])
    (want,) = torch.autograd.grad(torch.nn.functional.embedding(ids, w), [w], dys[0])
    assert torch.equal(got, want)


def _expert_grads(use_kernel: bool, split: bool, master: bool, micro_batches: int = 3):
    """GroupedExperts' w13 and w2 gradients after `micro_batches` forward/backward passes with bf16
    parameters (or precision.WeightCopies' copies of float32 masters), through the fused grouped
    GEMM or the reference; split: the pipeline's input-only pass (on a leaf input, as DualPipeV's
    phases hand it over) then the weight pass."""
    from pithtrain.kernels.wgrad import owner as wgrad_owner
    from pithtrain.precision import Precision

    torch.manual_seed(0)
    experts = common.GroupedExperts(8, 256, 192).cuda()
    torch.nn.init.normal_(experts.w13_EDF2, std=0.05)
    torch.nn.init.normal_(experts.w2_EFD, std=0.05)
    if not master:
        for p in experts.parameters():
            p.data = p.data.bfloat16()
    precision = Precision(torch.bfloat16, "cuda", copy="all" if master else "none")
    if use_kernel:
        from pithtrain.kernels import wgrad
        experts.mm = functools.partial(wgrad.grouped_mm, reference=common.grouped_mm, copies=precision.copies)
    counts = torch.tensor([300, 0, 17, 211, 5, 400, 64, 3], device="cuda")
    with precision.weights(experts):
        for i in range(micro_batches):
            x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = experts(x if split else x * 1, counts)
            if split:
                grads = [wgrad_owner(p, precision.copies).grad for p in experts.parameters()]
                before = [None if g is None else g.clone() for g in grads]
                (dx,) = torch.autograd.grad(y, [x], dy, retain_graph=True)
                for g, b in zip(grads, before):  # the input-only pass adds no weight gradient
                    assert (g is None and b is None) or torch.equal(g, b)
                torch.autograd.backward(y, dy, inputs=list(experts.parameters()))
            else:
                y.backward(dy)
                dx = x.grad
            assert dx is not None and torch.isfinite(dx).all()
    return experts.w13_EDF2.grad, experts.w2_EFD.grad


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("master", [False, True])
def test_wgrad_grouped_mm_accumulates_like_autograd(split, master):
    """kernels/wgrad.grouped_mm over 3 micro-batches against autograd's grouped GEMM + add_: the same
    gradients (bf16 parameters, and float32 masters under their bf16 copies, where the kernel adds into
    the master's float32 .grad), also when the pipeline first asks for input gradients only (no
    weight gradient may land then) and then for the weights."""
    from pithtrain.kernels import wgrad

    calls, accumulate = [], wgrad.accumulate
    wgrad.accumulate = lambda g, *a, add=True: calls.append((g.dtype, add)) or accumulate(g, *a, add=add)
    try:
        got = _expert_grads(True, split, master)
    finally:
        wgrad.accumulate = accumulate
    want = torch.float32 if master else torch.bfloat16
    # w13 and w2 in micro-batches 2 and 3; the first goes through autograd, or writes the float32 master
    assert calls == [(want, False)] * 2 * master + [(want, True)] * 4, calls
    ref = _expert_grads(False, False, master)
    for g, r in zip(got, ref):  # (a gradient counted twice or missed is off by >= 1/3)
        assert g.dtype == want and rel(g, r) < (5e-3 if master else 1e-2), rel(g, r)


def test_wgrad_grouped_mm_returns_gradients_to_autograd_grad():
    """torch.autograd.grad w.r.t. the weights of a model using kernels/wgrad.grouped_mm returns them
    (as the reference does) and leaves an existing .grad untouched."""
    from pithtrain.kernels import wgrad

    torch.manual_seed(0)
    w = torch.nn.Parameter(0.05 * torch.randn(4, 256, 128, device="cuda", dtype=torch.bfloat16))
    w.grad = torch.zeros_like(w)
    x = torch.randn(900, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor([100, 100, 700, 900], device="cuda")
    dy = torch.randn(900, 128, device="cuda", dtype=torch.bfloat16)
    got = torch.autograd.grad(wgrad.grouped_mm(x, w, offs, reference=common.grouped_mm), [w, x], dy)
    ref = torch.autograd.grad(common.grouped_mm(x, w, offs), [w, x], dy)
    assert all(rel(a, b) < 1e-3 for a, b in zip(got, ref))  # returned, not added into .grad
    assert not w.grad.any()
