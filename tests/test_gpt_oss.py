"""GPT-OSS against Hugging Face's own GptOssForCausalLM: logits, gradients, import/export, MXFP4."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pithtrain.checkpoint import load_hf, save_hf  # noqa: E402
from pithtrain.config import load_config  # noqa: E402
from pithtrain.metrics import param_counts  # noqa: E402
from pithtrain.models import FAMILIES, build_model, read_config  # noqa: E402
from pithtrain.models.gpt_oss import dequantize_mxfp4  # noqa: E402

WINDOW, SEQ = 8, 24  # the sequence is 3 windows long


def hf_tiny(tmp_path, layer_types=("sliding_attention", "full_attention", "full_attention"),
            intermediate=16, hidden=32):
    # head_dim 16 with the published YaRN settings puts the YaRN ramp inside the rotary dims
    cfg = transformers.GptOssConfig(
        vocab_size=96, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=len(layer_types), layer_types=list(layer_types), num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=WINDOW, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).float()
    with torch.no_grad():  # larger than HF's init so sinks, biases, clamps and routing all matter
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.3 if ("sinks" in n or "bias" in n or "router" in n) else 0.1)
            if n.endswith("gate_up_proj_bias"):  # some pre-activations beyond the clamp at 7
                p.normal_(0, 6.0)
    model.save_pretrained(tmp_path / "hf")
    return model


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.mark.quick
def test_logits_and_grads_match_transformers(tmp_path):
    ref = hf_tiny(tmp_path)
    ours = load_hf(tmp_path / "hf", aux_loss_coeff=0.0)
    assert [layer.self_attn.window for layer in ours.layers] == [WINDOW, None, None]
    ids = torch.randint(0, 96, (2, SEQ))
    ours.train(), ref.train()
    lo, lr = ours(ids), ref(ids).logits
    assert rel(lo, lr) < 1e-5
    labels = torch.randint(0, 96, (2, SEQ))
    torch.nn.functional.cross_entropy(lo.flatten(0, 1), labels.flatten()).backward()
    torch.nn.functional.cross_entropy(lr.flatten(0, 1), labels.flatten()).backward()
    # our gradients in hub names and layouts, through the same function export uses
    fam = FAMILIES["gpt_oss"]
    hub_grads = {key: g for n, p in ours.named_parameters() for key, g in fam.native_to_hf(ours.cfg, n, p.grad)}
    ref_grads = dict((n, p.grad) for n, p in ref.named_parameters())
    assert hub_grads.keys() == ref_grads.keys()
    for n, g in ref_grads.items():
        assert rel(hub_grads[n], g) < 1e-5, n


def test_sliding_window_and_sinks_matter(tmp_path):
    """Guards the parity test against passing trivially: a full-attention first layer or zero sinks
    would change the logits."""
    hf_tiny(tmp_path)
    ours = load_hf(tmp_path / "hf").eval()
    ids = torch.randint(0, 96, (1, SEQ))
    with torch.no_grad():
        base = ours(ids)
        ours.layers[0].self_attn.window = None
        assert rel(ours(ids), base) > 1e-3
        ours.layers[0].self_attn.window = WINDOW
        ours.layers[0].self_attn.sinks_H.zero_()
        assert rel(ours(ids), base) > 1e-3


def test_round_trip_through_transformers(tmp_path):
    ref = hf_tiny(tmp_path)
    ours = load_hf(tmp_path / "hf")
    save_hf(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    back = back.float().eval()
    assert back.config.layer_types == ref.config.layer_types
    assert back.config.rope_parameters == ref.config.rope_parameters
    ids = torch.randint(0, 96, (2, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref.eval()(ids).logits, rtol=1e-5, atol=1e-5)
    again = load_hf(tmp_path / "out")
    assert again.cfg == ours.cfg
    for (n1, p1), (n2, p2) in zip(ours.named_parameters(), again.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


# The published openai/gpt-oss-20b config.json (transformers 4.55 format: rope_scaling + rope_theta)
PUBLISHED_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}


def test_hub_config_is_checked_as_a_recipe_is(tmp_path):
    # the family's validate() runs on a hub config.json too (it used to for two families of three)
    (tmp_path / "config.json").write_text(json.dumps({**PUBLISHED_20B, "num_experts_per_tok": 64}))
    with pytest.raises(ValueError, match=r"top_k: 64 exceeds num_experts \(32\)"):
        read_config(tmp_path)
    nan_yarn = {**PUBLISHED_20B["rope_scaling"], "factor": float("nan")}  # nan passed a `< 1` check
    (tmp_path / "config.json").write_text(json.dumps({**PUBLISHED_20B, "rope_scaling": nan_yarn}))
    with pytest.raises(ValueError, match=r"yarn_factor: must be >= 1 \(or null for plain RoPE\), got nan"):
        read_config(tmp_path)


def test_published_config_reads_as_the_recipe():
    imported = FAMILIES["gpt_oss"].config.from_hf(PUBLISHED_20B)
    recipe = load_config("gpt-oss-20b").model
    recipe.layer_types = list(PUBLISHED_20B["layer_types"])  # the recipe spells them by default
    assert imported == recipe


# ---------------------------------------------------------------------------------------------
# MXFP4


def random_mxfp4(shape_ERG, gen):
    blocks = torch.randint(0, 256, (*shape_ERG, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(115, 135, shape_ERG, dtype=torch.uint8, generator=gen)
    return blocks, scales


@pytest.mark.quick
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantize_matches_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4((3, 40, 4), torch.Generator().manual_seed(0))
    ref_ECR = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # (E, in, out): HF's param layout
    ours_ERC = dequantize_mxfp4(blocks, scales, dtype=dtype)  # (E, out, in): as stored
    assert torch.equal(ours_ERC.transpose(1, 2), ref_ECR)
    assert ours_ERC.abs().max() > 0


def test_mxfp4_checkpoint_loads_like_dense(tmp_path):
    """Experts stored as *_blocks/*_scales load to the same model as the dense checkpoint holding
    transformers' own dequantisation of them."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_tiny(tmp_path, intermediate=32)  # MXFP4 blocks are 32 wide along the input dimension
    d = tmp_path / "hf"
    dense = load_file(d / "model.safetensors")
    quant = dict(dense)
    gen = torch.Generator().manual_seed(1)
    E, D, F_ = 8, 32, 32
    for key in list(dense):
        for proj, rows, cols in (("gate_up_proj", 2 * F_, D), ("down_proj", D, F_)):
            if key.endswith(f"experts.{proj}"):
                blocks, scales = random_mxfp4((E, rows, cols // 32), gen)
                del quant[key]
                quant[key + "_blocks"], quant[key + "_scales"] = blocks, scales
                dense[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    q = tmp_path / "mxfp4"
    q.mkdir()
    save_file(quant, q / "model.safetensors", metadata={"format": "pt"})
    save_file(dense, d / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (q / "config.json").write_text(json.dumps(cfg))
    a, b = load_hf(d), load_hf(q)
    for (n1, p1), (n2, p2) in zip(a.named_parameters(), b.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    ids = torch.randint(0, 96, (1, SEQ))
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


# ---------------------------------------------------------------------------------------------
# Sizes


@pytest.mark.quick
def test_gpt_oss_20b_parameter_counts(capsys):
    """The published 20.9B total / 3.6B active, on the meta device (nothing is allocated), as
    `invoke info` (pithtrain/info.py) prints them."""
    from pithtrain import info
    assert info.main(["--model", "gpt-oss-20b"]) == 0
    assert "24 layers, 20.91B total / 3.61B active parameters" in capsys.readouterr().out
    cfg = load_config("gpt-oss-20b")
    model = build_model(cfg.model, init=False)
    assert all(p.is_meta for p in model.parameters())
    assert [layer.self_attn.window for layer in model.layers[:3]] == [128, None, 128]
    total, active = param_counts(model, cfg.model)
    assert round(total / 1e9, 1) == 20.9, total
    assert round(active / 1e9, 1) == 3.6, active


def test_init_weights_follows_hf_scheme():
    cfg = load_config("gpt-oss-20b", ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
                                      "model.num_kv_heads=2", "model.head_dim=16", "model.intermediate_size=32",
                                      "model.vocab_size=300", "model.num_experts=4", "model.top_k=2"]).model
    model = build_model(cfg)
    layer = model.layers[0]
    assert torch.all(layer.self_attn.q_proj.bias == 0) and torch.all(layer.mlp.experts.b13_EF2 == 0)
    assert layer.mlp.router.bias.std() > 0 and layer.self_attn.sinks_H.std() > 0
    assert abs(layer.mlp.experts.w13_EDF2.std().item() - 0.02) < 0.002
    assert torch.all(model.norm.weight == 1)
    out = model(torch.randint(0, 300, (2, 10)))
    assert out.shape == (2, 10, 300) and torch.isfinite(out).all()
