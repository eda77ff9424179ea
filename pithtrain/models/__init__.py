"""Model families. A family is chosen by the one literal mapping below (recipe `model.family`).

Every family's causal-LM module has the same plain attributes, which the trainer, the pipeline
engine and `parallelize` use directly: `embed_tokens`, `rotary` (positions -> rope tables),
`layers` (ModuleList of decoder layers called as `layer(h_BSD, rope)`), `norm`, `lm_head`,
`init_weights()`, and `forward(input_ids, positions=None, labels=None)` returning logits, or the
summed token loss when labels are given.
"""

import torch

from pithtrain.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

FAMILIES = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
}


def build_model(model_cfg, device: torch.device | str = "cpu", init: bool = True) -> torch.nn.Module:
    """Build on the meta device, then materialise on `device` and initialise (no full-size model is
    ever allocated twice, and `parallelize` may run between the two steps: see train.py)."""
    cls = FAMILIES[model_cfg.family][1]
    with torch.device("meta"):
        model = cls(model_cfg)
    if init:
        model.to_empty(device=device)
        model.init_weights()
    return model
