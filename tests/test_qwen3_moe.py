"""Qwen3-MoE against Hugging Face's own Qwen3MoeForCausalLM: logits, gradients, import/export."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pithtrain.checkpoint import load_hf, save_hf  # noqa: E402
from pithtrain.models import FAMILIES  # noqa: E402


def hf_tiny(tmp_path, norm_topk_prob=True):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob, mlp_only_layers=[1],
        max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():  # HF zero-inits the router; random routers make routing non-trivial
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "hf")
    return model


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.mark.quick
def test_hub_names_and_per_expert_weights_round_trip():
    """models/hub.py: the hub's names ("model." but for the head) and its per-expert (out, in)
    weights are the stacked (E, in, out) tensors' slices, both ways, bit for bit."""
    from pithtrain.models.hub import hub_name, native_name, per_expert_to_stacked, stacked_to_per_expert
    assert [hub_name(n) for n in ("lm_head.weight", "norm.weight")] == ["lm_head.weight", "model.norm.weight"]
    assert native_name("model.norm.weight") == "norm.weight" and native_name("lm_head.weight") == "lm_head.weight"
    with pytest.raises(KeyError):
        native_name("norm.weight")
    w13, w2 = torch.randn(3, 4, 2 * 5), torch.randn(3, 5, 4)  # E=3 experts, D=4, F=5
    hub = dict(stacked_to_per_expert("layers.1.mlp.experts.w13_EDF2", w13, 5)
               + stacked_to_per_expert("layers.1.mlp.experts.w2_EFD", w2, 5))
    assert len(hub) == 9 and hub["model.layers.1.mlp.experts.2.up_proj.weight"].shape == (5, 4)
    back = {"layers.1.mlp.experts.w13_EDF2": torch.zeros_like(w13), "layers.1.mlp.experts.w2_EFD": torch.zeros_like(w2)}
    for key in hub:
        for name, index, t in per_expert_to_stacked(key, hub.get, 5):
            back[name][index] = t
    assert torch.equal(back["layers.1.mlp.experts.w13_EDF2"], w13)
    assert torch.equal(back["layers.1.mlp.experts.w2_EFD"], w2)
    hub["model.norm.weight"] = torch.ones(4)  # any other tensor: itself, under its native / hub name
    assert per_expert_to_stacked("model.norm.weight", hub.get, 5) == [("norm.weight", (), hub["model.norm.weight"])]
    assert stacked_to_per_expert("norm.weight", w2, 5) == [("model.norm.weight", w2)]


@pytest.mark.quick
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_and_grads_match_transformers(tmp_path, norm_topk_prob):
    ref = hf_tiny(tmp_path, norm_topk_prob)
    ours = load_hf(tmp_path / "hf", aux_loss_coeff=0.0)
    ids = torch.randint(0, 96, (2, 20))
    ours.train(), ref.train()
    lo, lr = ours(ids), ref(ids).logits
    assert rel(lo, lr) < 1e-5
    labels = torch.randint(0, 96, (2, 20))
    loss_o = torch.nn.functional.cross_entropy(lo.flatten(0, 1), labels.flatten())
    loss_r = torch.nn.functional.cross_entropy(lr.flatten(0, 1), labels.flatten())
    loss_o.backward(), loss_r.backward()
    # map our gradients to hub names with the same function export uses, then compare per tensor
    fam = FAMILIES["qwen3_moe"]
    ref_grads = {}
    for n, p in ref.named_parameters():
        ref_grads[n] = p.grad
    hub_grads = {}
    for n, p in ours.named_parameters():
        for key, g in fam.native_to_hf(ours.cfg, n, p.grad):
            hub_grads[key] = g
    # HF keeps experts fused in memory: compare through its own per-expert split
    for n, g in ref_grads.items():
        if n.endswith("experts.gate_up_proj"):
            base = n[: -len("gate_up_proj")]
            for e in range(g.shape[0]):
                gate, up = g[e].chunk(2, dim=0)
                assert rel(hub_grads[f"{base}{e}.gate_proj.weight"], gate) < 1e-5
                assert rel(hub_grads[f"{base}{e}.up_proj.weight"], up) < 1e-5
        elif n.endswith("experts.down_proj"):
            base = n[: -len("down_proj")]
            for e in range(g.shape[0]):
                assert rel(hub_grads[f"{base}{e}.down_proj.weight"], g[e]) < 1e-5
        else:
            assert rel(hub_grads[n], g) < 1e-5, n


def test_summed_loss_matches_logits_loss(tmp_path):
    hf_tiny(tmp_path)
    ours = load_hf(tmp_path / "hf", aux_loss_coeff=0.0)
    ids, labels = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))
    labels[0, :3] = -100
    total = ours(ids, labels_BS=labels)
    ref = torch.nn.functional.cross_entropy(ours(ids).flatten(0, 1), labels.flatten(),
                                            ignore_index=-100, reduction="sum")
    torch.testing.assert_close(total, ref)


@pytest.mark.parametrize("shard_bytes", [1 << 40, 20_000])
def test_round_trip_through_transformers(tmp_path, shard_bytes):
    ref = hf_tiny(tmp_path)
    ours = load_hf(tmp_path / "hf")
    save_hf(ours, tmp_path / "out", shard_bytes=shard_bytes)
    if shard_bytes < 1 << 30:
        assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref.eval()(ids).logits, rtol=1e-5, atol=1e-5)
    again = load_hf(tmp_path / "out")
    for (n1, p1), (n2, p2) in zip(ours.named_parameters(), again.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_save_hf_shards_keep_to_shard_bytes(tmp_path):
    """save_hf plans its shards as export does (hf.plan_shards): a shard passes shard_bytes only
    when one native tensor alone does (it used to take tensors until it had passed the limit)."""
    from safetensors import safe_open

    from pithtrain.checkpoint.hf import state_for_export
    hf_tiny(tmp_path)
    ours = load_hf(tmp_path / "hf")
    save_hf(ours, tmp_path / "out", shard_bytes=20_000)
    fam, cfg = FAMILIES[ours.cfg.family], ours.cfg
    native = {k: n for n, t in state_for_export(ours).items() for k, _ in fam.native_to_hf(cfg, n, t)}
    shards = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) > 1
    for f in shards:
        with safe_open(f, "pt") as st:
            nbytes = sum(st.get_tensor(k).nbytes for k in st.keys())
            assert nbytes <= 20_000 or len({native[k] for k in st.keys()}) == 1, (f.name, nbytes)


def test_export_over_an_earlier_export_leaves_no_stale_weights(tmp_path):
    """A single-file export, then a sharded one into the same folder: transformers must load the
    second, not the first's model.safetensors beside the new index; other files stay."""
    ref = hf_tiny(tmp_path)
    ours = load_hf(tmp_path / "hf")
    stale = load_hf(tmp_path / "hf")
    with torch.no_grad():
        for p in stale.parameters():
            p.add_(1.0)
    save_hf(stale, tmp_path / "out")
    (tmp_path / "out" / "tokenizer.json").write_text("{}")
    save_hf(ours, tmp_path / "out", shard_bytes=20_000)
    assert not (tmp_path / "out" / "model.safetensors").exists()
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref.eval()(ids).logits, rtol=1e-5, atol=1e-5)


def test_fused_experts_bf16_rope_table_and_refused_settings(tmp_path):
    """Three import cases: transformers 5's fused expert layout (save_original_format=False) is the
    same model; a bf16 load keeps RoPE's frequency table in float32 as transformers does; hub
    settings this model does not implement are refused, not silently run differently."""
    import shutil
    ref = hf_tiny(tmp_path)
    ref.save_pretrained(tmp_path / "fused", save_original_format=False)
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path / "fused")(ids), ref(ids).logits, rtol=1e-5, atol=1e-5)
    bf16, fp32 = load_hf(tmp_path / "hf", dtype=torch.bfloat16), load_hf(tmp_path / "hf")
    assert bf16.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(bf16.rotary.inv_freq, fp32.rotary.inv_freq)
    for key, value in (("use_sliding_window", True), ("hidden_act", "gelu")):
        bad = tmp_path / key
        shutil.copytree(tmp_path / "hf", bad)
        cfg = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ValueError, match=f"{key}={value!r} is not supported"):
            load_hf(bad)


def test_bad_checkpoints_name_the_file(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_tiny(tmp_path)
    d = tmp_path / "hf"
    # wrong shape
    sd = load_file(d / "model.safetensors")
    sd["model.norm.weight"] = torch.ones(7)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.norm.weight' has shape \(7,\)"):
        load_hf(d)
    # missing tensor
    del sd["model.norm.weight"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(ValueError, match="does not cover 1 parameters"):
        load_hf(d)
    # missing shard in an index
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-2.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-2.safetensors: shard listed"):
        load_hf(d)
    # unsupported architecture
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json: unsupported architecture"):
        load_hf(d)


def test_full_size_parameter_counts_match_published_figures():
    """Qwen3-30B-A3B: 30.5B total, 3.3B active (model card), counted on the meta device."""
    from pithtrain.metrics import param_counts
    from pithtrain.models import build_model
    from pithtrain.models.qwen3_moe import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                         num_kv_heads=4, head_dim=128, intermediate_size=6144,
                         moe_intermediate_size=768, num_experts=128, top_k=8)
    total, active = param_counts(build_model(cfg, init=False), cfg)
    # the card truncates: 30.53B total and 3.35B active (embedding and head included)
    assert abs(total / 1e9 - 30.5) < 0.05 and abs(active / 1e9 - 3.3) < 0.06, (total, active)


def test_training_starts_from_an_imported_checkpoint(tmp_path, tiny_overrides):
    """train.init_from: the first step's loss is the Hugging Face model's loss on that batch."""
    from pithtrain.config import load_config
    from pithtrain.data import build_batches
    from pithtrain.train import train

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=264, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128)
    torch.manual_seed(0)
    ref = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    ref.save_pretrained(tmp_path / "hf")
    run = load_config(None, tiny_overrides + ["train.steps=2", f"train.init_from={tmp_path / 'hf'}"])
    hist, _ = train(run)
    x, y = build_batches(run.data, run.train.seq_len, run.train.micro_batch_size, run.train.seed).batch(0)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten()).item()
    assert hist[0]["loss"] == pytest.approx(want, rel=1e-5)
    assert run.model.hidden_size == 32  # the checkpoint's config replaced the recipe's


def test_init_from_model_is_checked_against_the_data(tmp_path, tiny_overrides):
    """train.init_from trains the checkpoint's model: its vocabulary (96) is what the byte-level
    data (258 ids) must fit, not the recipe's model section (264), before anything is built."""
    from pithtrain.config import ConfigError, load_config
    hf_tiny(tmp_path)
    with pytest.raises(ConfigError, match=r"train.init_from's config.json vocab_size: the byte-level "
                                          r"stdlib data needs >= 258, got 96"):
        load_config(None, tiny_overrides + [f"train.init_from={tmp_path / 'hf'}"])


def test_init_from_missing_directory_is_a_config_error(tmp_path):
    from pithtrain.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="train.init_from: directory .* does not exist"):
        load_config(None, [f"train.init_from={tmp_path / 'nope'}"])


def test_tied_lm_head_stays_tied_through_build_and_import(tmp_path):
    """tie_word_embeddings: the head is the embedding after build_model and after load_hf (moving a
    meta-built model to a device gives each module its own tensor unless re-tied), and a tied
    transformers checkpoint imports with transformers' logits."""
    from pithtrain.models import build_model

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    ref = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.1)
    ref.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf", aux_loss_coeff=0.0).eval()
    assert ours.lm_head.weight is ours.embed_tokens.weight
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, rtol=1e-5, atol=1e-5)
    built = build_model(ours.cfg, "cpu")
    assert built.lm_head.weight is built.embed_tokens.weight
