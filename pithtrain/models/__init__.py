"""Model families. A family is chosen by the one literal mapping below (recipe `model.family`).

Every family's causal-LM module has the same plain attributes, which the trainer, the pipeline
engine and `parallelize` use directly: `embed_tokens`, `rotary` (positions -> rope tables),
`layers` (ModuleList of decoder layers called as `layer(h_BSD, rope)`), `norm`, `lm_head`,
`cross_entropy` (the head's loss), `init_weights()`, and `forward(input_ids, positions=None, labels=None, docs=None)` returning logits,
or the summed token loss when labels are given (docs: document index per token, document masking). Inside the layers, the units `parallelize` swaps are
plain attributes too: each MoE block's `dispatcher`, `experts` (GroupedExperts) and
`balance.stats_sum` (models/balance.py), and each attention module's `attention` call
(distributed/parallelize.py). The kernel choice is bound into attributes the same way
(`common.use_kernels`; see pithtrain/kernels/__init__.py).
"""

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
