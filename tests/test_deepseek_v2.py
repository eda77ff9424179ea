"""DeepSeek-V2 against Hugging Face's own DeepseekV2ForCausalLM: logits, gradients, import/export,
config import, and the real V2-Lite parameter counts (meta device)."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from pithtrain import config  # noqa: E402
from pithtrain.checkpoint import load_hf, save_hf  # noqa: E402
from pithtrain.config import load_config  # noqa: E402
from pithtrain.metrics import param_counts  # noqa: E402
from pithtrain.models import FAMILIES, build_model, read_config  # noqa: E402
from pithtrain.models.deepseek_v2 import DeepseekV2Config, MoE  # noqa: E402

V = 96
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=2, moe_intermediate_size=24, first_k_dense_replace=1,
            max_position_embeddings=256, rope_theta=10000.0)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1}
CASES = {
    # V2-Lite shape: plain q_proj, one dense layer, greedy routing, plain RoPE
    "lite": {},
    # V2 shape: low-rank q, two dense layers, group-limited routing with scaling, YaRN as published
    "v2": dict(q_lora_rank=48, first_k_dense_replace=2, num_hidden_layers=4, topk_method="group_limited_greedy",
               n_group=4, topk_group=2, num_experts_per_tok=3, routed_scaling_factor=2.5,
               rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}),
    # YaRN with mscale != mscale_all_dim (cos/sin scaled too), attention biases, one shared expert
    "yarn": dict(n_shared_experts=1, attention_bias=True,
                 rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.5, "rope_theta": 10000.0}),
    # no shared experts: transformers still saves their zero-width tensors
    "noshared": dict(n_shared_experts=0),
}


def hf_tiny(path, **overrides):
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**{**BASE, **overrides})).float()
    with torch.no_grad():  # HF zero-inits biases and 0.02-inits the rest: make every path non-trivial
        for n, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in n else p.normal_(0, 0.15)
    model.save_pretrained(path)
    return model


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def hf_grads_by_hub_key(model):
    """HF keeps experts fused in memory ((E, 2F, D) gate|up, (E, D, F) down): split them into the
    per-expert hub keys its save_pretrained writes."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if n.endswith("experts.gate_up_proj"):
            base = n[: -len("gate_up_proj")]
            for e in range(g.shape[0]):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = g[e].chunk(2, dim=0)
        elif n.endswith("experts.down_proj"):
            base = n[: -len("down_proj")]
            out.update({f"{base}{e}.down_proj.weight": g[e] for e in range(g.shape[0])})
        else:
            out[n] = g
    return out


@pytest.mark.quick
@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_grads_match_transformers(tmp_path, case):
    ref = hf_tiny(tmp_path / "hf", **CASES[case])
    ours = load_hf(tmp_path / "hf", aux_loss_coeff=0.0)  # HF's forward has no aux loss
    ours.train(), ref.train()
    torch.manual_seed(1)
    ids, labels = torch.randint(0, V, (2, 24)), torch.randint(0, V, (2, 24))
    lo, lr = ours(ids), ref(ids).logits
    assert rel(lo, lr) < 1e-5
    # the labelled path (chunked summed CE) against HF logits' CE, and every parameter's gradient
    loss_o = ours(ids, labels_BS=labels)
    loss_r = F.cross_entropy(lr.flatten(0, 1), labels.flatten(), reduction="sum")
    assert abs(loss_o.item() - loss_r.item()) < 1e-5 * loss_r.item()
    loss_o.backward(), loss_r.backward()
    ref_grads = hf_grads_by_hub_key(ref)
    fam = FAMILIES["deepseek_v2"]
    seen = set()
    for n, p in ours.named_parameters():
        for key, g in fam.native_to_hf(ours.cfg, n, p.grad):  # the mapping export uses
            assert rel(g, ref_grads[key]) < 1e-5, key
            seen.add(key)
    assert seen == {k for k, g in ref_grads.items() if g.numel()}  # HF's zero-width shared experts hold nothing


@pytest.mark.quick
def test_group_limited_routing_is_exercised():
    """The group mask changes the choice for some tokens (else the 'v2' parity case proves little)."""
    cfg = DeepseekV2Config(hidden_size=32, num_experts=8, top_k=3, topk_method="group_limited_greedy",
                           n_group=4, topk_group=2)
    torch.manual_seed(2)
    moe = MoE(cfg)
    torch.nn.init.normal_(moe.gate.weight, std=0.5)
    x = torch.randn(64, 32)
    idx_group = moe.route(x)[-1]
    moe.group_limited = False
    idx_greedy = moe.route(x)[-1]
    assert (idx_group.sort(-1).values != idx_greedy.sort(-1).values).any()
    groups = idx_group // 2  # 4 groups of 2 experts: each token's picks span at most 2 groups
    assert all(len(set(g.tolist())) <= 2 for g in groups)


@pytest.mark.parametrize("case", ["lite", "v2"])
def test_round_trip_import_export(tmp_path, case):
    ref = hf_tiny(tmp_path / "hf", **CASES[case])
    ours = load_hf(tmp_path / "hf")
    save_hf(ours, tmp_path / "out")
    again = transformers.DeepseekV2ForCausalLM.from_pretrained(tmp_path / "out").float()
    ids = torch.randint(0, V, (2, 16))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref(ids).logits)
        assert torch.equal(load_hf(tmp_path / "out")(ids), ours(ids))
    assert DeepseekV2Config.from_hf(again.config.to_dict()) == ours.cfg


def test_fused_expert_checkpoint_loads(tmp_path):
    """transformers 5's save_original_format=False writes each layer's experts fused
    (gate_up_proj (E, 2F, D), down_proj (E, D, F)): the same model as the per-expert layout."""
    ref = hf_tiny(tmp_path / "hf")
    ref.save_pretrained(tmp_path / "fused", save_original_format=False)
    ids = torch.randint(0, V, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path / "fused")(ids), ref(ids).logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(load_hf(tmp_path / "fused")(ids), load_hf(tmp_path / "hf")(ids))


# The hub's config.json of deepseek-ai/DeepSeek-V2-Lite (legacy rope_scaling + top-level rope_theta).
V2_LITE_HUB = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}


def test_recipe_is_the_published_v2_lite():
    """Recipe-owned fields aside (RECIPE_MODEL_FIELDS: those DeepSeek-V2 has; a variant's field may
    be another family's), the recipe is the hub's config."""
    cfg = load_config("deepseek-v2-lite").model
    hub = DeepseekV2Config.from_hf(V2_LITE_HUB)
    assert cfg.balance == "sequence"  # recipe-owned: DeepSeek-V2's own loss
    for k in set(config.RECIPE_MODEL_FIELDS) & {f.name for f in dataclasses.fields(cfg)}:
        setattr(hub, k, getattr(cfg, k))
    assert cfg == hub


def test_recipe_check_skips_a_recipe_owned_field_of_another_family(monkeypatch):
    """A variant's recipe-owned field may exist on one family only (the add-moe-variant skill's
    worked example adds a Qwen3-only one): the check above then takes DeepSeek-V2's fields only."""
    monkeypatch.setattr(config, "RECIPE_MODEL_FIELDS", (*config.RECIPE_MODEL_FIELDS, "sliding_window"))  # GPT-OSS's
    assert not hasattr(load_config("deepseek-v2-lite").model, "sliding_window")
    test_recipe_is_the_published_v2_lite()


def test_v2_lite_counts_15_7b_2_4b():
    cfg = load_config("deepseek-v2-lite").model
    model = build_model(cfg, init=False)  # meta device: shapes only
    assert all(p.is_meta for p in model.parameters())
    total, active = param_counts(model, cfg)
    assert round(total / 1e9, 1) == 15.7  # 15.706B
    # DeepSeek counts activated parameters without the input-embedding table (as V2's 21B and
    # V3's 37B do): 2.451B, published as 2.4B (2.661B with the table).
    assert round(active / 1e9, 2) == 2.45
    with torch.device("meta"):  # same parameter count as transformers' own module
        hf = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**V2_LITE_HUB))
    assert total == sum(p.numel() for p in hf.parameters())


def test_hub_config_refuses_what_transformers_does_not_implement(tmp_path):
    for bad, why in (({"norm_topk_prob": True}, "norm_topk_prob"), ({"num_key_value_heads": 8}, "MLA needs"),
                     ({"topk_method": "noaux_tc"}, "topk_method"),
                     ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope"),
                     ({"q_lora_rank": float("nan")}, r"q_lora_rank: must be >= 1 or null, got nan")):
        (tmp_path / "config.json").write_text(json.dumps({**V2_LITE_HUB, **bad}))
        with pytest.raises(ValueError, match=why):
            read_config(tmp_path)


def test_init_and_training_step_with_aux_loss():
    cfg = DeepseekV2Config(vocab_size=V, hidden_size=32, num_layers=3, num_heads=2, kv_lora_rank=16,
                           qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, intermediate_size=64,
                           moe_intermediate_size=16, num_experts=4, top_k=2, aux_loss_coeff=0.1,
                           rope_scaling=dict(YARN, mscale=0.707, mscale_all_dim=0.707))
    torch.manual_seed(3)
    model = build_model(cfg)
    w = model.layers[1].mlp.experts.w13_EDF2
    assert abs(w.std().item() - 0.02) < 0.002 and torch.all(model.norm.weight == 1)
    assert model.rotary.inv_freq.abs().sum() > 0  # buffers are set by init, not only by loading
    ids = torch.randint(0, V, (2, 16))
    model.train()
    loss = model(ids, labels_BS=ids)
    loss.backward()
    assert torch.isfinite(loss)
    assert model.layers[2].mlp.gate.weight.grad.abs().sum() > 0
    assert model.layers[2].mlp.balance.stats[:4].sum() == 2 * 16 * 2  # this step's routed slots
