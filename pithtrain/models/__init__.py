"""Model families. A family is chosen by the one literal mapping below (recipe `model.family`).

Every family's causal-LM module has the same plain attributes, which the trainer, the pipeline
engine and `parallelize` use directly: `embed_tokens`, `rotary` (positions -> rope tables),
`layers` (ModuleList of decoder layers called as `layer(h_BSD, rope)`), `norm`, `lm_head`,
`cross_entropy` (the head's loss), `init_weights()`, and `forward(input_ids, positions=None,
labels=None, docs=None)` returning logits, or the summed token loss when labels are given (docs:
document index per token, document masking). Inside the layers, the units `parallelize` swaps are
plain attributes too: each MoE block's `dispatcher`, `experts` (GroupedExperts) and
`balance.stats_sum` (models/balance.py), and each attention module's `attention` call
(distributed/parallelize.py). The kernel choice is bound into attributes the same way
(`common.use_kernels`; see pithtrain/kernels/__init__.py).
"""

import json
import re
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from pithtrain.models import deepseek_v2, gpt_oss, qwen3_moe


class Family(NamedTuple):
    config: type  # the recipe's model section
    model: type  # the causal-LM module
    hf_to_native: Callable  # hub tensor -> native parameter slices (pithtrain.checkpoint.hf)
    native_to_hf: Callable  # native parameter -> hub tensors


FAMILIES = {
    "qwen3_moe": Family(qwen3_moe.Qwen3MoeConfig, qwen3_moe.Qwen3MoeForCausalLM,
                        qwen3_moe.hf_to_native, qwen3_moe.native_to_hf),
    "deepseek_v2": Family(deepseek_v2.DeepseekV2Config, deepseek_v2.DeepseekV2ForCausalLM,
                          deepseek_v2.hf_to_native, deepseek_v2.native_to_hf),
    "gpt_oss": Family(gpt_oss.GptOssConfig, gpt_oss.GptOssForCausalLM, gpt_oss.hf_to_native, gpt_oss.native_to_hf),
}


def build_model(model_cfg, device: torch.device | str = "cpu", init: bool = True) -> torch.nn.Module:
    """Build on the meta device, then materialise on `device` and initialise (no full-size model is
    ever allocated twice, and `parallelize` may run between the two steps: see train.py)."""
    cls = FAMILIES[model_cfg.family].model
    with torch.device("meta"):
        model = cls(model_cfg)
    if init:
        to_empty(model, device)
        model.init_weights()
    return model


def to_empty(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """model.to_empty(device), keeping a tied LM head tied: to_empty gives every module its own
    new tensor, so the head and the embedding would silently train apart."""
    model.to_empty(device=device)
    if getattr(model.cfg, "tie_word_embeddings", False):
        model.lm_head.weight = model.embed_tokens.weight
    return model


# ---------------------------------------------------------------------------------------------
# A hub config.json -> the family config (hub tensor names: models/hub.py)


def read_config(path: Path):
    """(family name, family config) from a Hugging Face checkpoint directory's config.json, checked
    as a recipe's model section is; ValueError / FileNotFoundError naming the file otherwise."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file}: no config.json in the checkpoint directory")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e.msg})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object, got {type(hf).__name__}")
    for k, v in hf.items():  # "hidden_size": "4096" would reach comparisons and allocations
        if isinstance(v, str) and re.fullmatch(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*", v):
            raise ValueError(f"{cfg_file}: {k} is the string {v!r}, not a number")
    archs = hf.get("architectures") or []
    family = next((name for name, fam in FAMILIES.items() if fam.config.hf_architecture in archs), None)
    if family is None:
        supported = ", ".join(f.config.hf_architecture for f in FAMILIES.values())
        raise ValueError(f"{cfg_file}: unsupported architecture {archs or hf.get('model_type')!r} "
                         f"(supported: {supported})")

    def fail(key, msg):
        raise ValueError(f"{key}: {msg}")

    try:
        cfg = FAMILIES[family].config.from_hf(hf)
        cfg.validate(fail)  # sizes typed and bounded before anything is allocated
    except (KeyError, ValueError, TypeError) as e:  # TypeError: a size given as a string
        raise ValueError(f"{cfg_file}: cannot read {family} config: {type(e).__name__}: {e}") from None
    return family, cfg

