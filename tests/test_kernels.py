"""CPU side of the fused operators: the policy and each model's own choice, the PyTorch paths
(fused LM-head loss, activation checkpointing, compile-ability without graph breaks) against their
references, and no module-level mutable state read by model code. GPU kernels:
tests/test_kernels_gpu.py."""

import contextlib

import pytest
import torch
from run_path import one_gpu_kernels

from pithtrain import kernels
from pithtrain.compile import apply_activation_checkpoint, apply_compile
from pithtrain.kernels import fp8_linear
from pithtrain.kernels.linear_ce import linear_cross_entropy_sum
from pithtrain.models import FAMILIES
from pithtrain.models.balance import Balance
from pithtrain.models.common import LocalDispatcher, _ce_chunk, attention_kernels, dispatch_plan, use_kernels
from pithtrain.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM


@pytest.mark.quick
def test_configure_turns_the_attention_kernels_off_under_context_parallel(monkeypatch):
    """On a (simulated) Hopper GPU with flash-attn-4 installed the attention kernels are chosen;
    under context parallel, whose own attention replaces the model's, none of them is; under
    float32 compute flash-attn-4 (bf16 / fp16 kernels only) is not listed as running."""
    from pithtrain.kernels import fa4

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(fa4, "HAVE_FA4", True)
    attn = ("flex", "cudnn_sdpa", "fa4")
    assert all(one_gpu_kernels("auto", "cuda")[k] for k in attn)
    assert not any(one_gpu_kernels("auto", "cuda", cp=True)[k] for k in attn)
    use = one_gpu_kernels("auto", "cuda", bf16=False)
    assert use["flex"] and use["cudnn_sdpa"] and not use["fa4"]


def fake_hopper_with_fa4(monkeypatch):
    """The device facts of a Hopper GPU with flash-attn-4 and cuDNN installed, on CPU."""
    from pithtrain.kernels import fa4

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(fa4, "HAVE_FA4", True)


@pytest.mark.quick
def test_flash_attn_4_runs_only_the_layers_its_tested_shapes_cover(monkeypatch):
    """Kernel choice by shape (issue #49): on a (simulated) Hopper GPU with flash-attn-4, a layer
    runs it only where kernels/fa4.py's tested shapes cover the layer's `attention_shapes`; a
    variant layer at another shape (two maps per head of half width, as Diff attention declares)
    or with its own attention call keeps SDPA / FlexAttention, the rotary then makes the document
    masks under bf16 autocast, and the start-up line says which layers run which kernel."""
    from pithtrain.kernels import fa4
    from pithtrain.models.common import Rotary

    fake_hopper_with_fa4(monkeypatch)

    class Variant(Qwen3MoeConfig):
        def attention_shapes(self, i):
            window, d_qk, d_v, heads = super().attention_shapes(i)
            return (window, d_qk // 2, d_v, 2 * heads) if i == 1 else (window, d_qk, d_v, heads)

    def own_attention(q, k, v, **kw):  # a variant's own call: use_kernels leaves it alone
        raise AssertionError("not called")

    dims = dict(vocab_size=64, hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=64,
                moe_intermediate_size=16, num_experts=4, top_k=2)
    assert fa4.covers(Variant(**dims).attention_shapes(0)) and not fa4.covers(Variant(**dims).attention_shapes(1))
    use = one_gpu_kernels("auto", "cuda")
    assert use["fa4"] and use["flex"]
    plain = use_kernels(Qwen3MoeForCausalLM(Qwen3MoeConfig(**dims)), use)
    assert plain.rotary.fa4 and plain.rotary.fa4_all
    assert kernels.describe(use, attention_kernels(plain, use)).endswith("; attention: layers 0-3 flash-attn-4")
    model = Qwen3MoeForCausalLM(Variant(**dims))
    model.layers[3].self_attn.attention = own_attention
    use_kernels(model, use)
    calls = [layer.self_attn.attention for layer in model.layers]
    assert [c.keywords["fa4"] for c in calls[:3]] == [True, False, True] and calls[3] is own_attention
    assert model.rotary.fa4 and not model.rotary.fa4_all
    line = kernels.describe(use, attention_kernels(model, use))
    assert line.endswith("; attention: layers 0, 2 flash-attn-4; layer 1 cuDNN SDPA/FlexAttention (d_qk 32, d_v 64: "
                         "not a shape flash-attn-4 is tested at, kernels/fa4.py); layer 3 "
                         f"{own_attention.__qualname__}"), line

    class Masks:  # stands in for kernels.flex.FlexAttention's document masks (CUDA only)
        def document_masks(self, docs_BS):
            return {None: "block mask"}

    docs, pos = torch.tensor([[0, 0, 1, 1]]), torch.arange(4)[None]
    for m, masks in ((plain, None), (model, {None: "block mask"})):
        rotary = Rotary(8, 10000.0)  # on CPU, with the flags use_kernels set
        rotary.reset_parameters()
        rotary.flex, rotary.fa4, rotary.fa4_all = Masks(), m.rotary.fa4, m.rotary.fa4_all
        with torch.autocast("cpu", dtype=torch.bfloat16):
            d = rotary(pos, docs).docs
        assert d.block_masks == masks and d.cu_seqlens.tolist() == [0, 2, 4]


def test_the_published_families_run_flash_attn_4_on_every_layer():
    """Every layer of the embedded full-size recipes is at a shape flash-attn-4 is tested at
    (kernels/fa4.py TESTED): the kernel choice by shape costs them nothing."""
    from pithtrain.config import load_config
    from pithtrain.kernels import fa4

    for name in ("qwen3-30b-a3b", "deepseek-v2-lite", "gpt-oss-20b"):
        m = load_config(name).model
        assert all(fa4.covers(m.attention_shapes(i)) for i in range(m.num_layers)), name


def test_configure_takes_every_fact_of_the_run():
    """No fact has a default that turns a path on: a new FSDP caller that forgets fsdp=True must
    not get the in-place weight gradients FSDP's reduced gradients do not survive."""
    with pytest.raises(TypeError, match="fsdp"):
        kernels.configure("auto", "cuda", fp8=False, bf16=True, experts_alone=False, cp=False)


def test_configure_on_cpu_picks_references_and_says_so():
    use = one_gpu_kernels("auto", "cpu")
    assert set(use) == set(kernels.NAMES)
    assert use["linear_ce"] and not use["swiglu"] and not use["permute"] and not use["flex"]
    line = kernels.describe(use, attention_kernels(tiny_qwen(), use))
    assert line.startswith("kernels: fused linear_ce; PyTorch reference for swiglu")
    assert line.endswith("; attention: layers 0-1 SDPA/eager")
    assert not any(one_gpu_kernels("torch", "cpu").values())
    assert not any(one_gpu_kernels("auto", "cpu", off=("linear_ce",)).values())  # the bench's no-NAME


def test_two_models_in_one_process_each_run_their_own_kernels():
    """Kernel choices live in each model (use_kernels), not in the process: an FP8 model and a
    reference model built and run interleaved; only the FP8 one quantises, the reference one gives
    exactly what a fresh reference model gives, and the FP8 one what it gives alone."""
    x = torch.randint(0, 64, (2, 12))

    def run(model):
        model.zero_grad()
        loss = model(x, labels_BS=x)
        loss.backward()
        return loss.item()

    fast = use_kernels(tiny_qwen(), one_gpu_kernels("auto", "cpu", fp8=True))
    ref = use_kernels(tiny_qwen(), one_gpu_kernels("torch", "cpu"))
    fast_loss, ref_loss = run(fast), run(ref)
    assert fp8_linear.quantised(fast) == 2 * 2 and fp8_linear.quantised(ref) == 0  # w13, w2 per layer
    assert ref_loss == run(tiny_qwen()) and fast_loss != ref_loss
    assert fast_loss == run(use_kernels(tiny_qwen(), one_gpu_kernels("auto", "cpu", fp8=True)))
    assert fast.cross_entropy.keywords["fused"] and not ref.cross_entropy.keywords["fused"]


@pytest.mark.quick
@pytest.mark.parametrize("chunk", [5, 7, 64])
def test_linear_cross_entropy_matches_reference(chunk):
    torch.manual_seed(0)
    T, D, V = 23, 16, 50
    h = torch.randn(T, D, requires_grad=True)
    w = torch.randn(V, D, requires_grad=True)
    labels = torch.randint(0, V, (T,))
    labels[[0, 4, 22]] = -100
    loss = linear_cross_entropy_sum(h, w, labels, chunk)
    (2.5 * loss).backward()
    ref = _ce_chunk(h, w, labels)
    gh, gw = torch.autograd.grad(2.5 * ref, (h, w))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(h.grad, gh)
    torch.testing.assert_close(w.grad, gw)


def test_linear_cross_entropy_without_rows():
    """No rows (an empty shard): zero loss and zero gradients, as the reference gives."""
    h = torch.randn(0, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    loss = linear_cross_entropy_sum(h, w, torch.zeros(0, dtype=torch.long), 8)
    loss.backward()
    assert loss.item() == 0 and h.grad.shape == (0, 16) and torch.equal(w.grad, torch.zeros_like(w))


def tiny_qwen():
    torch.manual_seed(1)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, moe_intermediate_size=24, num_experts=4, top_k=2)
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights()
    return model


def loss_and_grads(model, x, y, saved=None):
    """saved: a list that gets the bytes autograd saves for backward outside any checkpoint (inside
    one, non-reentrant checkpointing's own saved-tensor hooks take over and keep nothing)."""
    model.zero_grad()

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks if saved is not None else contextlib.nullcontext():
        loss = model(x, labels_BS=y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["cheap", "selective", "full"])
def test_activation_checkpoint_recomputes_and_keeps_loss_and_grads(mode):
    """Checkpointing really recomputes in backward (full: whole layers, attention included;
    selective: the experts only; cheap: the attention phase's pointwise work and the experts'
    activation, entering the attention call and the experts' second GEMM again, whose kernels it
    does not rerun: test_cheap_reruns_no_gemm_and_no_attention_kernel), counted through the
    modules' swappable calls, and really saves less for backward (full: little beyond the layers'
    inputs; selective: at least the experts' hidden activations, top_k rows per token, 2F + F
    wide; cheap: at least their activation, F wide); loss and gradients stay those of the run
    without it."""
    model = tiny_qwen()
    calls = {"attention": 0, "experts": 0}

    def counted(kind, fn):
        def call(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return call
    for layer in model.layers:
        layer.self_attn.attention = counted("attention", layer.self_attn.attention)
        layer.mlp.experts.mm = counted("experts", layer.mlp.experts.mm)  # twice per forward: w13, w2
    x, y = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12))
    ref_saved, saved = [0], [0]
    ref_loss, ref_grads = loss_and_grads(model, x, y, ref_saved)
    assert calls == {"attention": 2, "experts": 4}  # 2 layers, no recompute
    apply_activation_checkpoint(model, mode)
    loss, grads = loss_and_grads(model, x, y, saved)
    recomputed = {"full": {"attention": 2, "experts": 4}, "selective": {"attention": 0, "experts": 4},
                  "cheap": {"attention": 2, "experts": 2}}[mode]
    assert calls == {k: 2 * v + recomputed[k] for k, v in {"attention": 2, "experts": 4}.items()}, calls
    cfg = model.cfg
    width = 3 if mode != "cheap" else 1  # selective: [gate | up] and the activation; cheap: the activation
    hidden = cfg.num_layers * x.numel() * cfg.top_k * width * cfg.moe_intermediate_size * 4  # float32 bytes
    assert ref_saved[0] - saved[0] >= hidden, (mode, ref_saved, saved)
    assert (saved[0] < ref_saved[0] / 4) == (mode == "full"), (mode, ref_saved, saved)
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], msg=lambda m: f"{n}: {m}")


def test_cheap_reruns_no_gemm_and_no_attention_kernel():
    """The witness of "cheap": its backward runs the same GEMMs and attention kernels as the
    backward without checkpointing (pithtrain/compile.py's KEPT_OPS, counted under a dispatch mode: none
    is run again to recompute), and more pointwise work (the norms' rsqrt: recomputed)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pithtrain.compile import KEPT_OPS

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kept, self.rsqrt = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.kept += func in KEPT_OPS
            self.rsqrt += func is torch.ops.aten.rsqrt.default
            return func(*args, **(kwargs or {}))
    counts = {}
    x = torch.randint(0, 64, (2, 12))
    for mode in ("none", "cheap"):
        model = tiny_qwen()
        apply_activation_checkpoint(model, mode)
        loss = model(x, labels_BS=x)
        with Count() as counts[mode]:
            loss.backward()
    assert counts["cheap"].kept == counts["none"].kept > 0
    assert counts["cheap"].rsqrt > counts["none"].rsqrt


@pytest.mark.parametrize("family,mode", [(f, m) for f in sorted(FAMILIES) for m in ("none", "cheap")])
def test_every_family_compiles_without_graph_breaks(family, mode):
    """fullgraph=True turns any graph break in the compiled parts into an error; the 'eager'
    backend makes this a tracing check that needs no compiler on CPU. "cheap" activation
    checkpointing (its selective checkpoint traced inside the attention phase and the dense and
    shared-expert MLPs, before compile) compiles whole too, with every family's gradients those of
    the eager run without it."""
    import dataclasses

    cfg_cls, model_cls = FAMILIES[family][0], FAMILIES[family][1]
    small = {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
             "head_dim": 8, "moe_intermediate_size": 16, "intermediate_size": 32, "num_experts": 4,
             "top_k": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
             "v_head_dim": 8, "sliding_window": 4, "n_shared_experts": 1,
             # the balancing unit's compiled observe: both losses, DeepSeek's sequence-level one
             "balance": "sequence" if family == "deepseek_v2" else "switch", "z_loss_coeff": 0.01}
    names = {f.name for f in dataclasses.fields(cfg_cls)}
    cfg = cfg_cls(**{k: v for k, v in small.items() if k in names})
    torch.manual_seed(2)
    model = model_cls(cfg)
    model.init_weights()
    balances = [m for m in model.modules() if isinstance(m, Balance)]
    x, y = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12))
    ref_loss, ref_grads = loss_and_grads(model, x, y)
    ref_stats = [b.stats.clone() for b in balances]
    for b in balances:
        b.stats.zero_()
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    apply_activation_checkpoint(model, mode)
    apply_activation_checkpoint(model, mode)
    apply_compile(model, backend="eager")
    loss, grads = loss_and_grads(model, x, y)
    # compiled for real: graphs for the attention phase, the router with its balancing unit and
    # the dispatch plan (layers share them)
    assert counters["stats"]["unique_graphs"] >= 3, dict(counters["stats"])
    moes = [m for m in model.modules() if hasattr(m, "balance")]
    assert moes and all(hasattr(m.routing, "_torchdynamo_orig_callable") for m in moes)  # compiled
    for b, ref in zip(balances, ref_stats, strict=True):
        assert ref.sum() > 0
        torch.testing.assert_close(b.stats, ref)  # the load counted once per micro-batch, as eager
    torch.testing.assert_close(loss, ref_loss)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], msg=lambda m: f"{n}: {m}")
    torch._dynamo.reset()


@pytest.mark.quick
def test_bench_variant_words_and_table():
    from pithtrain.bench import parse_variant, table

    v = parse_variant("fused+compile+ac-sel+no-permute")
    assert v == {"kernels": "auto", "compile": True, "ac": "selective", "bf16": False, "fp8": False,
                 "off": ["permute"]}
    assert parse_variant("fused+bf16")["bf16"]
    assert parse_variant("ref")["kernels"] == "torch"
    assert parse_variant("fused+compile+fp8")["fp8"]
    assert parse_variant("fused+fp8+no-deepgemm")["off"] == ["deepgemm"]  # FP8 on the Triton kernels
    with pytest.raises(SystemExit, match="no-deepgemm changes only fp8 variants"):
        parse_variant("fused+no-deepgemm")  # a switch that would do nothing
    with pytest.raises(SystemExit):
        parse_variant("fused+turbo")
    from pithtrain.bench import main  # every variant is checked before anything is built or timed
    with pytest.raises(SystemExit, match="'ref\\+fp8': fp8 runs Triton GEMMs"):
        main(["--variants", "ref,fused", "--fp8"])
    with pytest.raises(SystemExit, match="unknown peers"):
        main(["--peers", "transformers,megatron"])
    with pytest.raises(SystemExit, match="--grad-accum takes positive integers"):
        main(["--grad-accum", "1,0"])
    with pytest.raises(SystemExit, match="--doc-len .* times PithTrain's sides only"):
        main(["--doc-len", "1024"])  # the peers would be timed without documents

    def rec(side, tps, mb=8, **kw):
        return {"model": "m", "side": side, "grad_accum": mb, "ok": True, "tokens_per_s": tps,
                "mfu": tps / 1e4, "peak_gb": 1.0, "step_ms": 1e4 / tps, **kw}

    recs = [rec("fused", 2e3), rec("transformers", 1e3), rec("fused+fp8", 3e3), rec("fused+bf16", 2.5e3),
            {"model": "m", "side": "torchtitan", "grad_accum": 8, "ok": False, "error": "Unsupported: guard"},
            rec("torchtitan eager", 1.6e3),
            rec("fused", 4e3, mb=1), rec("torchtitan", 2e3, mb=1)]
    out = table(recs)
    # train.py's step: against transformers, torchtitan's eager row (its compile failed), bf16 params
    assert "| m | 8 | fused | 2.0K | 20.0% | 1.0 | 5.0 | 2.00x | 1.25x | - | 0.80x |" in out
    assert "| m | 8 | fused+fp8 | 3.0K | 30.0% | 1.0 | 3.3 | 3.00x | 1.88x | 1.50x | - |" in out  # FP8 vs twin
    assert "| m | 8 | torchtitan | failed: Unsupported: guard |" in out  # a failing peer is a row
    assert "| m | 8 | torchtitan eager | 1.6K | 16.0% | 1.0 | 6.2 | - | - | - | - |" in out
    assert "| m | 1 | fused | 4.0K | 40.0% | 1.0 | 2.5 | - | 2.00x | - | - |" in out  # settings kept apart


def test_bench_documents():
    """--doc-len's documents (bench.random_documents): each row cut into documents whose ids rise
    by one at each start, of the asked mean length, the same for the same seed."""
    from pithtrain.bench import bench_config, random_documents
    from pithtrain.models.common import document_starts

    cfg = bench_config("qwen3-30b-a3b", 4, 2, 4096)
    docs = random_documents(cfg, "cpu", 512)
    assert docs.shape == (2, 4096) and torch.equal(docs, random_documents(cfg, "cpu", 512))
    step = docs[:, 1:] - docs[:, :-1]
    assert ((step == 0) | (step == 1)).all() and (docs[:, 0] == 0).all()
    lengths = (lambda cu: cu[1:] - cu[:-1])(document_starts(docs)).float()
    assert 8 < len(lengths) < 40 and 256 < lengths.mean() < 1024, lengths  # 16 expected, mean 512 (rows cut)


def test_bench_refuses_what_train_py_refuses_and_peers_do_not_fail_it():
    """At 12 layers float32 masters fit one H200 for DeepSeek-V2-Lite and not for Qwen3 (the plan
    train.py checks); such a side is a `refused` row, and neither it nor a failed peer fails the run."""
    from pithtrain.bench import bench_config, exit_status, refused_by_plan, table

    assert refused_by_plan(bench_config("deepseek-v2-lite", 12, 2, 4096, 1), 140.4) is None
    why = refused_by_plan(bench_config("qwen3-30b-a3b", 12, 2, 4096, 1), 140.4)
    assert why.startswith("train.py refuses it here: memory plan 137.") and "of 129.2 usable" in why, why
    refused = {"model": "m", "side": "fused", "grad_accum": 1, "ok": False, "refused": True,
               "error": "PlanRefused: " + why}
    peer = {"model": "m", "side": "torchtitan", "grad_accum": 1, "ok": False, "error": "OutOfMemoryError: x | y"}
    ok = {"model": "m", "side": "fused+bf16", "grad_accum": 1, "ok": True, "tokens_per_s": 1e3, "mfu": 0.1,
          "peak_gb": 1.0, "step_ms": 1.0}
    assert exit_status([refused, peer, ok], ["fused", "fused+bf16"]) == 0
    assert exit_status([dict(refused, refused=False), peer, ok], ["fused", "fused+bf16"]) == 1
    out = table([refused, peer, ok])
    assert "| m | 1 | fused | refused: PlanRefused: train.py refuses it here" in out
    assert "| m | 1 | torchtitan | failed: OutOfMemoryError: x / y |" in out  # a | in an error keeps the table


def test_bench_torchtitan_missing_is_a_row(monkeypatch):
    """Where torchtitan is not installed, the bench says so in its row instead of dropping it."""
    import builtins

    from pithtrain.bench import bench_config, peer_sides

    real_import = builtins.__import__

    def no_torchtitan(name, *a, **kw):
        if name.split(".")[0] == "torchtitan":
            raise ImportError("No module named 'torchtitan'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_torchtitan)
    cfg = bench_config("qwen3-30b-a3b", 1, 1, 16, 8)
    recs = peer_sides("qwen3-30b-a3b", cfg, torch.device("cpu"), ["torchtitan"], 1, 1, None)
    assert recs == [{"model": "qwen3-30b-a3b", "side": "torchtitan", "grad_accum": 8, "ok": False,
                     "error": "not installed (No module named 'torchtitan'; docs/bench.md says how)"}]


@pytest.mark.quick
def test_model_rotary_makes_its_flex_masks_eagerly():
    """A model's FlexAttention masks (one per window and length) are made by its `rotary`, which runs
    eagerly before the layers, and kept by that model only."""
    from pithtrain.kernels.flex import FlexAttention

    cfg_cls, model_cls = FAMILIES["gpt_oss"][0], FAMILIES["gpt_oss"][1]
    cfg = cfg_cls(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, intermediate_size=32, num_experts=4, top_k=2, sliding_window=4)
    model, other = model_cls(cfg), model_cls(cfg)
    model.init_weights()
    made = []
    model.rotary.flex = FlexAttention(cfg.window(i) for i in range(cfg.num_layers))  # attention: reference
    model.rotary.flex.block_mask = lambda S, w, device, make=model.rotary.flex.block_mask: (
        made.append((S, w, torch.compiler.is_compiling())) or make(S, w, device))
    torch._dynamo.reset()
    apply_compile(model, backend="eager")
    model(torch.randint(0, 64, (2, 12)), labels_BS=torch.randint(0, 64, (2, 12)))
    assert set(model.rotary.flex.masks) == {(12, 4, "cpu"), (12, None, "cpu")}
    assert sorted(made, key=str) == [(12, 4, False), (12, None, False)]  # eagerly, before the layers
    assert other.rotary.flex is None
    torch._dynamo.reset()


def test_balance_observe_stays_eager_under_context_parallel():
    """Context parallel sums the balancing statistics with an all-reduce (`stats_sum`): apply_compile
    then compiles the router alone and leaves the balancing unit eager; otherwise both as one graph."""
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, moe_intermediate_size=24, num_experts=4, top_k=2)
    model = Qwen3MoeForCausalLM(cfg)
    balances = [m for m in model.modules() if isinstance(m, Balance)]
    balances[0].stats_sum = lambda t: t  # stands in for ContextParallelSum
    torch._dynamo.reset()
    apply_compile(model, backend="eager")
    moes = [m for m in model.modules() if hasattr(m, "balance")]
    assert [hasattr(m, "routing") for m in moes] == [False, True]
    assert all(hasattr(m.route, "_torchdynamo_orig_callable") for m in moes)
    assert not any(hasattr(b.observe, "_torchdynamo_orig_callable") for b in balances)
    torch._dynamo.reset()


def test_dispatch_plan_is_one_graph_without_a_sorting_index_put():
    """The local dispatcher's index plan compiles whole (apply_compile sets it) and gives the
    stable expert order, the slots per expert and, for the fused permute, each slot's place.
    Inductor turns index_add_ on int64 counts into aten.index_put_(accumulate=True), which on CUDA
    sorts the indices first: 45 ms of Qwen3's 12-layer step at 8 micro-batches in the profile
    (docs/perf-notes.md). The plan counts with scatter_add_, atomics, as eager index_add_ did."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    idx_TA = torch.randint(0, 8, (512, 2))
    flat_X = idx_TA.reshape(-1)
    torch._dynamo.reset()
    plan = torch.compile(dispatch_plan, fullgraph=True)
    (order_X, counts_E, inv_TA), code = run_and_get_code(plan, idx_TA, 8, True)
    assert "aten.index_put_" not in "\n".join(code)
    assert torch.equal(order_X, torch.argsort(flat_X, stable=True))
    assert torch.equal(counts_E, torch.bincount(flat_X, minlength=8))
    assert torch.equal(order_X[inv_TA.reshape(-1)], torch.arange(flat_X.numel()))
    assert plan(idx_TA, 8, False)[2] is None
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                               num_kv_heads=2, head_dim=8, moe_intermediate_size=24,
                                               num_experts=4, top_k=2))
    apply_compile(model, backend="eager")
    dispatchers = [m.dispatcher for m in model.modules() if isinstance(getattr(m, "dispatcher", None), LocalDispatcher)]
    assert len(dispatchers) == 2 and all(hasattr(d.plan, "_torchdynamo_orig_callable") for d in dispatchers)
    torch._dynamo.reset()


def test_layers_share_compiled_graphs_within_default_dynamo_limits():
    """apply_compile leaves dynamo's process-wide limits alone: inlined modules make every layer
    reuse the first layer's graphs, so 12 layers compile to one graph per kind (attention phase;
    router with its balancing unit; dispatch plan), not one per layer that would need raised
    recompile limits."""
    torch.manual_seed(1)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_layers=12, num_heads=4, num_kv_heads=2,
                         head_dim=8, moe_intermediate_size=24, num_experts=4, top_k=2)
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights()
    limits = dict(torch._dynamo.config.get_config_copy())
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    apply_compile(model, backend="eager")
    x = torch.randint(0, 64, (2, 12))
    model(x, labels_BS=x).backward()
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])
    assert dict(torch._dynamo.config.get_config_copy()) == limits
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# No module-level mutable state read by model code (STYLE 16)

MUTATING_METHODS = {"update", "clear", "append", "extend", "pop", "popitem", "setdefault", "add", "remove",
                    "insert", "discard", "setitem", "setattr"}  # the last two: monkeypatch.X(obj, ...)


def mutable_state_reads(sources: dict, readers) -> list:
    """(reader, module, name, what changes it) for each read, in the `readers` modules, of a
    module-level name of any module in `sources` (module name -> source) that some module mutates:
    item assignment, a mutating method call, attribute assignment on it (a class attribute set from
    outside), or rebinding through `global`. `what changes it`: "module:line: statement" of each
    mutation. A module's own top-level names win over names it imports inside a function (a test's
    own FAMILIES dict is not pithtrain.models.FAMILIES because one of its tests imports that)."""
    import ast

    trees = {m: ast.parse(src) for m, src in sources.items()}
    top = {m: {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
           | {n.name for n in tree.body if isinstance(n, ast.ClassDef)} for m, tree in trees.items()}

    def resolver(mod, tree):
        names, nested = {}, {}  # local name -> (module, None) for a module, (module, name) for a name in it
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module in trees or (
                    isinstance(n, ast.ImportFrom) and any(f"{n.module}.{a.name}" in trees for a in n.names)):
                for a in n.names:
                    sub = f"{n.module}.{a.name}"
                    (names if n in tree.body else nested)[a.asname or a.name] = (
                        (sub, None) if sub in trees else (n.module, a.name))
            elif isinstance(n, ast.Import):
                (names if n in tree.body else nested).update(
                    {a.asname: (a.name, None) for a in n.names if a.asname and a.name in trees})

        def resolve(e):
            if isinstance(e, ast.Name):
                own = (mod, e.id) if e.id in top[mod] else None
                return names.get(e.id, own or nested.get(e.id))
            if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name):
                r = names.get(e.value.id, nested.get(e.value.id))
                return (r[0], e.attr) if r and r[1] is None else None
            return None
        return resolve

    mutated = {}  # (module, name) -> where
    for mod, tree in trees.items():
        resolve = resolver(mod, tree)
        for n in ast.walk(tree):
            hits = []
            if isinstance(n, ast.Global):
                hits += [(mod, g) for g in n.names]
            targets = (n.targets if isinstance(n, ast.Assign)
                       else [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                if isinstance(t, (ast.Subscript, ast.Attribute)):
                    r = resolve(t.value)
                    hits.append(r if r is None or r[1] is not None else (r[0], t.attr))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MUTATING_METHODS \
                    and not (isinstance(n.func.value, ast.Name)
                             and n.func.value.id == "monkeypatch"):  # undone after its test
                hits.append(resolve(n.args[0] if n.func.attr.startswith("set") and n.args else n.func.value))
            for r in hits:
                if r and r[1] is not None and r[1] in top.get(r[0], ()):
                    mutated.setdefault(r, set()).add(
                        f"{mod}:{n.lineno}: {ast.get_source_segment(sources[mod], n).splitlines()[0]}")
    reads = set()
    for mod in readers:
        resolve = resolver(mod, trees[mod])
        reads |= {(mod, *r, "; ".join(sorted(mutated[r]))) for n in ast.walk(trees[mod])
                  if isinstance(n, (ast.Name, ast.Attribute)) and isinstance(n.ctx, ast.Load)
                  and (r := resolve(n)) in mutated}
    return sorted(reads)


def test_model_code_reads_no_module_level_mutable_state():
    """pithtrain/models/ and compile.py read no module-level state that any module of the package
    or the tests mutates; the scan itself finds such a read (the old kernels.USE pattern) and names
    what changes it, and a test's own dict of the same name as a package's is not the package's.
    pytest's monkeypatch (undone when its test ends) is not a mutation."""
    from pathlib import Path

    old = {"pkg.kernels": "USE = {'swiglu': False}\ndef configure():\n    USE.update(swiglu=True)\n",
           "pkg.common": "from pkg import kernels\ndef swiglu(h):\n    return kernels.USE['swiglu']\n",
           "pkg.aux": "class AuxLoss:\n    scale = 1.0\n",
           "pkg.train": "from pkg.aux import AuxLoss\nAuxLoss.scale = 0.5\n",
           "pkg.model": "from pkg.aux import AuxLoss\ndef f():\n    return AuxLoss.scale\n",
           "pkg.models": "FAMILIES = {'a': 1}\ndef build():\n    return FAMILIES['a']\n",
           "tests.test_x": "FAMILIES = {}\nFAMILIES['mine'] = 1\ndef test_f():\n"
                           "    from pkg.models import FAMILIES\n    return FAMILIES\n"}
    assert mutable_state_reads(old, ["pkg.common", "pkg.model", "pkg.models"]) == [
        ("pkg.common", "pkg.kernels", "USE", "pkg.kernels:3: USE.update(swiglu=True)"),
        ("pkg.model", "pkg.aux", "AuxLoss", "pkg.train:2: AuxLoss.scale = 0.5")]
    root = Path(__file__).resolve().parents[1]
    files = sorted(root.glob("pithtrain/**/*.py")) + sorted(root.glob("tests/*.py"))
    name = {f: ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__") for f in files}
    sources = {name[f]: f.read_text() for f in files}
    readers = [m for m in sources if m.startswith("pithtrain.models") or m == "pithtrain.compile"]
    assert len(readers) == 9  # compile, models/ (package, balance, common, hub, init, three families)
    found = mutable_state_reads(sources, readers)
    assert found == [], "\n".join(f"{reader} reads {mod}.{n}, changed at {where}" for reader, mod, n, where in found)
    for m in readers:
        for gone in ("kernels.USE", "fp8.CACHE", "AuxLoss.loss_scale", "_MASKS"):
            assert gone not in sources[m], (m, gone)


@pytest.mark.quick
@pytest.mark.parametrize("sinks", [False, True])
def test_flash_attn_4_ops_trace_forward_and_backward_on_meta(sinks):
    """The flash-attn-4 custom ops' shape functions and autograd registration (kernels/fa4.py), on
    the meta device (no GPU, no package): GQA with d_qk != d_v, each gradient shaped as its input,
    the sinks' gradient in the sinks' dtype. The numbers are the GPU test's
    (tests/test_kernels_gpu.py::test_flash_attn_4_matches_eager)."""
    from pithtrain.kernels import fa4

    B, S, H, K, d, e = 2, 64, 16, 4, 24, 16
    q, k, v = (torch.empty(B, S, n, w, device="meta", dtype=torch.bfloat16, requires_grad=True)
               for n, w in ((H, d), (K, d), (K, e)))
    s = torch.empty(H, device="meta", dtype=torch.bfloat16, requires_grad=True) if sinks else None
    out = fa4.attention(q, k, v, scale=d ** -0.5, window=8, sinks_H=s)
    assert (out.shape, out.dtype) == ((B, S, H, e), torch.bfloat16)
    out.sum().backward()
    assert [x.grad.shape for x in (q, k, v)] == [x.shape for x in (q, k, v)]
    if sinks:
        assert (s.grad.shape, s.grad.dtype) == ((H,), torch.bfloat16)


@pytest.mark.parametrize("window", [None, 8])
def test_flash_attn_4_documents_trace_through_the_varlen_ops_on_meta(window, monkeypatch):
    """Documents with flash-attn-4 (common.attention given docs.cu_seqlens, fa4 on) take the
    varlen ops on the meta device: the tokens flattened to (B * S, H, d), the output back as
    (B, H, S, d_v), each gradient shaped as its input; without the starts (FlexAttention's block
    masks only) the call never reaches the ops."""
    from pithtrain.kernels import fa4
    from pithtrain.models import common

    B, S, H, K, d, e = 2, 64, 16, 4, 24, 16
    q, k, v = (torch.empty(B, n, S, w, device="meta", dtype=torch.bfloat16, requires_grad=True)
               for n, w in ((H, d), (K, d), (K, e)))
    s = torch.empty(H, device="meta", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.empty(5, device="meta", dtype=torch.int32)  # four documents
    seen = []
    for op in ("fa4_fwd", "fa4_bwd"):
        real = getattr(fa4, op)

        def spy(*args, real=real, op=op):
            seen.append((op, [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args]))
            return real(*args)

        monkeypatch.setattr(fa4, op, spy)
    docs = common.Documents(torch.empty(B, S, device="meta", dtype=torch.long), None, cu)
    out = common.attention(q, k, v, scale=d ** -0.5, window=window, sinks_H=s, docs=docs, fa4=True)
    ref = common.attention(q, k, v, scale=d ** -0.5, window=window, sinks_H=s,
                           docs=docs._replace(cu_seqlens=None), fa4=True)  # the eager reference
    assert (out.shape, out.dtype) == ((B, H, S, e), torch.bfloat16) and ref.shape == out.shape
    out.sum().backward()
    assert [x.grad.shape for x in (q, k, v, s)] == [x.shape for x in (q, k, v, s)]
    T, w = B * S, window or 0
    assert seen == [("fa4_fwd", [(T, H, d), (T, K, d), (T, K, e), d ** -0.5, w, (H,), (5,), S]),
                    ("fa4_bwd", [(T, H, e), (T, H, d), (T, K, d), (T, K, e), (T, H, e), (H, T), d ** -0.5, w,
                                 (H,), (5,), S])]
