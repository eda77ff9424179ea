"""Hugging Face tensor names, shared by the families' hub mappings (`hf_to_native`, `native_to_hf`):
the hub prefixes every tensor but the head with "model.", and stores routed experts per expert (or
fused per layer) where this package stacks them. Reading a hub directory is checkpoint/hf.py's;
its config.json becomes a family config in models/__init__.py (`read_config`).
"""

from __future__ import annotations

import re

import torch

# (config field, config.json key[, default when the hub omits the key]): the keys every family maps
# alike; a family's HF_KEYS adds its own. A key without a default is required (KeyError).
COMMON_KEYS = (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"), ("num_layers", "num_hidden_layers"),
               ("num_heads", "num_attention_heads"), ("rms_norm_eps", "rms_norm_eps"),
               ("max_position_embeddings", "max_position_embeddings"),
               ("tie_word_embeddings", "tie_word_embeddings", False), ("init_std", "initializer_range", 0.02))


def fields_from_hf(hf: dict, keys: tuple) -> dict:
    """The config fields COMMON_KEYS and a family's `keys` read from a hub config.json (fields_to_hf
    writes them)."""
    return {k[0]: hf.get(k[1], k[2]) if len(k) > 2 else hf[k[1]] for k in COMMON_KEYS + keys}


def field_names(keys: tuple) -> tuple:
    """The config fields COMMON_KEYS and a family's `keys` map: the start of its `hub_fields`."""
    return tuple(k[0] for k in COMMON_KEYS + keys)


def fields_to_hf(cfg, keys: tuple) -> dict:
    """The config.json keys of COMMON_KEYS and a family's `keys`, with its architecture (its to_hf
    adds the keys no table maps)."""
    return {"architectures": [cfg.hf_architecture], "model_type": cfg.family, "hidden_act": "silu",
            **{k[1]: getattr(cfg, k[0]) for k in COMMON_KEYS + keys}}


def hub_name(native: str) -> str:
    return native if native.startswith("lm_head.") else "model." + native


def native_name(hub: str) -> str:
    if hub.startswith("lm_head."):
        return hub
    if not hub.startswith("model."):
        raise KeyError(hub)
    return hub[len("model."):]


_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def per_expert_to_stacked(hf_key: str, get, hidden: int):
    """Hub per-expert weights (out, in) (Qwen3, DeepSeek) as slices of the stacked (E, in, out)
    tensors: gate -> w13[e, :, :F], up -> w13[e, :, F:], down -> w2[e]. transformers 5 can also
    save them fused per layer (save_original_format=False): gate_up_proj (E, 2F, D) with [gate; up]
    rows, down_proj (E, D, F); each is the stacked tensor transposed. Any other key is the same
    tensor under its native name (the hub name without "model.")."""
    m = _FUSED_EXPERTS.fullmatch(hf_key)
    if m is not None:
        name = "w13_EDF2" if m[2] == "gate_up_proj" else "w2_EFD"
        return [(f"layers.{m[1]}.mlp.experts.{name}", (), get(hf_key).transpose(1, 2))]
    m = _PER_EXPERT.fullmatch(hf_key)
    if m is None:
        return [(native_name(hf_key), (), get(hf_key))]
    layer, e, which = int(m[1]), int(m[2]), m[3]
    base = f"layers.{layer}.mlp.experts."
    w = get(hf_key).t()
    if which == "down":
        return [(base + "w2_EFD", (e,), w)]
    cols = slice(0, hidden) if which == "gate" else slice(hidden, 2 * hidden)
    return [(base + "w13_EDF2", (e, slice(None), cols), w)]


def stacked_to_per_expert(name: str, t: torch.Tensor, hidden: int):
    """The inverse of per_expert_to_stacked for one native tensor (a non-expert one: its hub name)."""
    if name.endswith("experts.w13_EDF2"):
        prefix = hub_name(name[: -len("w13_EDF2")])
        return [(f"{prefix}{e}.{w}_proj.weight", t[e, :, cols].t())
                for e in range(t.shape[0]) for w, cols in (("gate", slice(0, hidden)), ("up", slice(hidden, None)))]
    if name.endswith("experts.w2_EFD"):
        prefix = hub_name(name[: -len("w2_EFD")])
        return [(f"{prefix}{e}.down_proj.weight", t[e].t()) for e in range(t.shape[0])]
    return [(hub_name(name), t)]
