"""Document masking (data.document_mask): attention stays inside each document and positions
restart per document, for the three families; the reference is each document run on its own."""

import dataclasses

import numpy as np
import pytest
import torch
from run_path import one_gpu_kernels

from pithtrain.data import document_ids
from pithtrain.models import build_model
from pithtrain.models.common import document_positions
from pithtrain.models.deepseek_v2 import DeepseekV2Config
from pithtrain.models.gpt_oss import GptOssConfig
from pithtrain.models.qwen3_moe import Qwen3MoeConfig

V = 64
FAMILY_CONFIGS = {
    "qwen3_moe": Qwen3MoeConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                head_dim=8, moe_intermediate_size=16, num_experts=4, top_k=2),
    "deepseek_v2": DeepseekV2Config(vocab_size=V, hidden_size=32, num_layers=2, num_heads=2, kv_lora_rank=16,
                                    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                                    intermediate_size=48, moe_intermediate_size=16, num_experts=4, top_k=2,
                                    first_k_dense_replace=1),
    # a window (5) shorter than the documents, on the sliding layer; sinks on every layer
    "gpt_oss": GptOssConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=8, intermediate_size=16, num_experts=4, top_k=2, sliding_window=5),
}
# FlexAttention's Triton kernels need head dims of at least 16 (the H200 run at a0ad5e8 refused 8)
GPU_CONFIGS = {
    "qwen3_moe": dataclasses.replace(FAMILY_CONFIGS["qwen3_moe"], head_dim=16),
    "deepseek_v2": dataclasses.replace(FAMILY_CONFIGS["deepseek_v2"], qk_nope_head_dim=16, qk_rope_head_dim=16,
                                       v_head_dim=16),
    "gpt_oss": dataclasses.replace(FAMILY_CONFIGS["gpt_oss"], head_dim=16),
}


def test_document_ids_and_positions():
    eos = 9
    x = torch.tensor([[1, 2, 9, 3, 4, 5, 9, 9, 6], [9, 1, 2, 3, 4, 5, 6, 7, 8]])
    docs = document_ids(x, eos)
    # a document ends with its separator; the next starts right after it
    assert docs.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0], [0, 0, 1, 2, 3, 4, 5, 6, 7]]


def test_document_starts_and_what_the_rotary_prepares():
    """flash-attn-4's varlen starts (common.document_starts) over the rows taken one after another,
    a row's first token starting a document even when its id continues the row before; the
    rotary makes them when flash-attn-4 is some layer's attention, and FlexAttention's block masks
    unless it is every layer's and takes the batch (half-precision autocast)."""
    from pithtrain.models.common import Rotary, document_starts

    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0, 1],
                         [1, 1, 1, 1, 1, 1, 1, 1, 1]])  # the last row's id continues the row before
    cu = document_starts(docs)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 7, 8, 9, 10, 18, 26, 27, 36]
    lengths = (cu[1:] - cu[:-1]).tolist()
    assert lengths == [3, 4, 1, 1, 1, 8, 8, 1, 9] and sum(lengths) == docs.numel()

    class Masks:  # stands in for kernels.flex.FlexAttention (CUDA only)
        def document_masks(self, docs_BS):
            return {None: "block mask"}

        def prepare(self, S, device):  # the causal masks of batches without documents
            pass

    rotary = Rotary(8, 10000.0)
    rotary.reset_parameters()
    pos = torch.arange(9).expand(4, 9)
    rotary.flex = Masks()
    assert rotary(pos, docs).docs == (docs, {None: "block mask"}, None)
    rotary.fa4 = rotary.fa4_all = True  # every layer's attention is flash-attn-4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        d = rotary(pos, docs).docs
    assert d.block_masks is None and d.cu_seqlens.tolist() == cu.tolist()
    rotary.fa4_all = False  # some layer's is not (its shape untested: common.use_kernels): it needs the masks
    with torch.autocast("cpu", dtype=torch.bfloat16):
        d = rotary(pos, docs).docs
    assert d.block_masks == {None: "block mask"} and d.cu_seqlens.tolist() == cu.tolist()
    d = rotary(pos, docs).docs  # float32: the attention will take FlexAttention, so both are made
    assert d.block_masks == {None: "block mask"} and d.cu_seqlens.tolist() == cu.tolist()
    assert rotary(pos).docs is None


def test_separator_loss_mask_and_unsupported_layouts(tiny_overrides):
    from pithtrain.config import ConfigError, load_config
    from pithtrain.data import TokenBatches

    tokens = np.tile(np.array([5, 6, 7, 9, 8, 9], dtype=np.uint16), 100)
    plain = TokenBatches(tokens, 16, 4, 0, eos=9)
    masked = TokenBatches(tokens, 16, 4, 0, eos=9, mask_separator=True)
    (x, y), (xm, ym) = plain.batch(3), masked.batch(3)
    assert torch.equal(x, xm) and torch.equal(ym[x != 9], y[x != 9])  # only the label after a separator
    assert (ym[x == 9] == -100).all() and (x == 9).any()
    from pithtrain.build import check_run
    for layout in ("parallel.cp=2", "parallel.pp=2"):  # refused once the layout is known, before anything is built
        cfg = load_config(None, tiny_overrides + ["data.document_mask=true", layout])
        with pytest.raises(ConfigError, match=rf"data.document_mask: not supported with {layout.split('=')[0]} > 1"):
            check_run(cfg, torch.device("cpu"), 2)


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_document_mask_equals_each_document_alone(family):
    torch.manual_seed(0)
    model = build_model(FAMILY_CONFIGS[family]).eval()
    lengths = [[7, 11, 3, 9], [30]]  # row 0: four documents (one shorter than the window), row 1: one
    x = torch.randint(0, V, (2, 30))
    docs = torch.tensor([sum([[d] * n for d, n in enumerate(row)], []) for row in lengths])
    seen = []  # RoPE is relative, so restarted positions change no output: check what rotary gets
    model.rotary.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    with torch.no_grad():
        masked = model(x, docs_BS=docs)
        assert seen[0][0].tolist() == [*range(7), *range(11), *range(3), *range(9)]
        plain = model(x)
        for b, row in enumerate(lengths):
            start = 0
            for n in row:
                alone = model(x[b:b + 1, start:start + n])[0]  # positions 0..n-1, no other tokens
                torch.testing.assert_close(masked[b, start:start + n], alone, rtol=1e-5, atol=1e-5)
                start += n
    # the mask matters: without it the later documents of row 0 see the earlier ones
    assert not torch.allclose(masked[0, 7:], plain[0, 7:], atol=1e-3)
    torch.testing.assert_close(masked[1], plain[1], rtol=1e-5, atol=1e-5)  # one document: no change


def test_loss_falls_on_a_two_document_corpus(tmp_path, tiny_overrides):
    """Two documents, repeated, with document masking and separator loss masking: training learns."""
    from pithtrain.config import load_config
    from pithtrain.train import train
    from tests.test_data import write_shards

    rng = np.random.default_rng(0)
    eos = 63
    doc_a, doc_b = rng.integers(0, 60, 40), rng.integers(0, 60, 25)
    corpus = np.concatenate([np.concatenate([doc_a, [eos], doc_b, [eos]]) for _ in range(200)])
    d = write_shards(tmp_path / "s", [corpus], vocab_size=64, eos_id=eos)
    run = [o for o in tiny_overrides if not o.startswith(("train.steps", "data."))]
    hist, _ = train(load_config(None, run + ["train.steps=40", "data.source=shards", f"data.path={d}",
                                          "model.vocab_size=64", "data.document_mask=true",
                                          "data.mask_separator_loss=true"]))
    first = sum(h["loss"] for h in hist[:3]) / 3
    last = sum(h["loss"] for h in hist[-3:]) / 3
    assert first > 3.5 and last < first - 2.0, (first, last)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", list(GPU_CONFIGS))
def test_flex_document_mask_matches_the_eager_reference_on_gpu(family):
    """CUDA: the document mask runs as FlexAttention block masks (built once per batch); float32
    loss and every gradient equal the eager reference's, and outputs equal each document alone."""
    from pithtrain.models.common import use_kernels

    torch.manual_seed(0)
    model = build_model(GPU_CONFIGS[family], "cuda")
    lengths = [100, 60, 96]
    x = torch.randint(0, V, (2, 256), device="cuda")
    docs = torch.tensor([sum([[d] * n for d, n in enumerate(lengths)], [])] * 2, device="cuda")
    runs = {}
    for mode in ("auto", "torch"):
        use_kernels(model, one_gpu_kernels(mode, "cuda"))
        seen = []
        hook = model.rotary.register_forward_hook(lambda m, args, out: seen.append(out.docs))
        model.zero_grad()
        loss = model(x, labels_BS=x, docs_BS=docs)
        loss.backward()
        hook.remove()
        assert (seen[0].block_masks is not None) == (mode == "auto")  # flex ran, or the reference
        runs[mode] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
        if mode == "auto":
            with torch.no_grad():
                masked, start = model(x, docs_BS=docs), 0
                for n in lengths:
                    torch.testing.assert_close(masked[0, start:start + n], model(x[:1, start:start + n])[0],
                                               rtol=1e-4, atol=1e-4)
                    start += n
    assert runs["auto"][0] == pytest.approx(runs["torch"][0], rel=1e-4)
    for n, g in runs["auto"][1].items():
        torch.testing.assert_close(g, runs["torch"][1][n], rtol=1e-3, atol=1e-5, msg=lambda m: f"{n}: {m}")


# flash-attn-4's head dims: the families' shapes at widths its kernels take (64)
FA4_CONFIGS = {
    "qwen3_moe": dataclasses.replace(FAMILY_CONFIGS["qwen3_moe"], head_dim=64, hidden_size=64),
    "deepseek_v2": dataclasses.replace(FAMILY_CONFIGS["deepseek_v2"], qk_nope_head_dim=32, qk_rope_head_dim=32,
                                       v_head_dim=64, hidden_size=64),
    "gpt_oss": dataclasses.replace(FAMILY_CONFIGS["gpt_oss"], head_dim=64, hidden_size=64, sliding_window=64),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", list(FA4_CONFIGS))
def test_flash_attn_4_document_mask_matches_flex_attention_on_gpu(family, monkeypatch):
    """CUDA, bf16 autocast as train.py runs: with flash-attn-4 the document mask runs on its varlen
    interface (the rotary makes the documents' starts and no block masks), and the loss and every
    gradient match FlexAttention's document masks within bf16 noise; eager, then compiled as
    train.py runs it, over batches with different numbers of documents (the starts' length
    changes: the compiled attention takes it without a graph per batch)."""
    from pithtrain.compile import apply_compile
    from pithtrain.kernels import fa4
    from pithtrain.models.common import use_kernels

    if not fa4.HAVE_FA4:
        pytest.skip("flash-attn-4 is not installed")
    ops = []
    real_fwd = fa4.fa4_fwd
    monkeypatch.setattr(fa4, "fa4_fwd", lambda *a: ops.append(a[-2].shape) or real_fwd(*a))
    torch.manual_seed(0)
    model = build_model(FA4_CONFIGS[family], "cuda")
    batches = []
    for lengths in ([[100, 300, 112], [512]], [[40, 200, 72, 200], [256, 256]], [[512], [7, 505]]):
        docs = torch.tensor([sum([[d] * n for d, n in enumerate(row)], []) for row in lengths], device="cuda")
        batches.append((torch.randint(0, V, (2, 512), device="cuda"), docs))

    def run(x, docs):
        seen = []
        hook = model.rotary.register_forward_hook(lambda m, args, out: seen.append(out.docs))
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, labels_BS=x, docs_BS=docs)
        loss.backward()
        hook.remove()
        return seen[0], loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    use_kernels(model, one_gpu_kernels("auto", "cuda", off=("fa4",)))
    flex = [run(*b) for b in batches]
    assert all(d.block_masks is not None and d.cu_seqlens is None for d, _, _ in flex) and not ops
    use_kernels(model, one_gpu_kernels("auto", "cuda"))
    for compiled in (False, True):
        if compiled:  # without the spy: dynamo would guard on its list's length and compile again
            monkeypatch.setattr(fa4, "fa4_fwd", real_fwd)
            torch._dynamo.reset()
            apply_compile(model)
            torch._dynamo.utils.counters.clear()
        graphs = []
        for (docs, loss, g), (x, ids) in zip(flex, batches, strict=True):
            d4, loss4, g4 = run(x, ids)
            assert d4.block_masks is None and d4.cu_seqlens is not None
            if not compiled:  # each layer's attention ran on the package (eagerly the spy sees every call)
                assert ops == [d4.cu_seqlens.shape] * model.cfg.num_layers, ops
                ops.clear()
            assert loss4 == pytest.approx(loss, rel=2e-2)
            assert ((g4 - g).norm() / g.norm()).item() < 3e-2
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        if compiled:  # the first batch compiles, the second may recompile with the starts' length dynamic
            assert graphs[0] > 0 and graphs[2] == graphs[1], graphs  # the third batch compiles nothing
    torch._dynamo.reset()
