"""Activation checkpointing and torch.compile for the decoder layers, applied in place.

Order (see parallelize's contract in DESIGN/STYLE): expert parallel -> context parallel ->
`apply_activation_checkpoint` -> `apply_compile` -> FSDP. Both walk the decoder layers
(`common.decoder_layers`: all of them, or a pipeline stage's) and the plain attributes every
family has (`self_attn`, `input_layernorm`, `post_attention_layernorm`, `mlp`, and inside a MoE
block `route`, `experts`, `dispatcher`, optional `shared_experts`).

What is compiled (fullgraph=True: a graph break is an error, not a silent slow path):
  every child of a layer that holds no experts (attention with its projections, RoPE and q/k
  norms; the norms; dense MLP layers), and inside a MoE block the router (`route`) and any other
  expert-free child (shared experts). Dispatch, the grouped expert GEMMs and combine stay eager:
  their shapes depend on the routing (per-expert row counts), and they already run as a few large
  kernels (grouped GEMM, Triton permute/SwiGLU) that a compiler would not improve.

Activation checkpointing (`train.activation_checkpoint`):
  "full"       recompute each whole decoder layer in backward (least memory, ~1/3 more compute);
  "selective"  recompute only the expert computation: a MoE layer's grouped experts (and shared
               experts), a dense layer's `mlp`. The routed experts' hidden activations (top_k
               rows per token, 2F + F wide) are the largest share of a MoE layer's saved memory,
               and their recompute is one grouped-GEMM forward; attention's saved tensors, and
               the dispatched rows (the checkpoint's input), are kept. Dispatch and combine stay
               outside the checkpoint, so expert parallel's all-to-all is never run twice.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pithtrain import kernels
from pithtrain.models.common import GroupedExperts, decoder_layers


def _has_experts(m: nn.Module) -> bool:
    return any(isinstance(x, GroupedExperts) for x in m.modules())


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpoint(model: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    for layer in decoder_layers(model):
        mlp = layer.mlp
        if mode == "full":
            targets = [layer]
        elif hasattr(mlp, "dispatcher"):  # a MoE block: its phases call the experts directly
            targets = [mlp.experts] + ([mlp.shared_experts] if getattr(mlp, "shared_experts", None) else [])
        else:
            targets = [mlp]
        for target in targets:
            target.forward = functools.partial(_checkpointed, target.forward)


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    """torch.compile(fullgraph=True) on the non-MoE parts of every layer (module identity and
    parameter names unchanged: nn.Module.compile)."""
    dyn = torch._dynamo.config
    # Each layer instance is one more guarded entry of the same code; allow one per layer and mode.
    layers = decoder_layers(model)  # a pipeline stage holds some of them
    limit = 4 * len(layers) + 8
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(dyn, name):
            setattr(dyn, name, max(getattr(dyn, name), limit if name != "accumulated_recompile_limit"
                                   else 8 * limit))
    for layer in layers:
        for child in layer.children():
            if not _has_experts(child):
                child.compile(fullgraph=True, backend=backend)
                continue
            if hasattr(child, "route"):
                child.route = torch.compile(child.route, fullgraph=True, backend=backend)
            for sub in child.children():
                if not _has_experts(sub) and not isinstance(sub, nn.Linear):  # e.g. shared experts
                    sub.compile(fullgraph=True, backend=backend)
    cfg = model.cfg
    windows = [cfg.attention_shapes(i)[0] for i in range(cfg.num_layers)]
    flex = any(w is not None for w in windows) or any("sinks" in n for n, _ in model.named_parameters())
    if kernels.USE["flex"] and flex:
        hook = functools.partial(_prepare_flex_masks, windows)
        for layer in layers:  # layers run eagerly also inside pipeline stages
            layer.register_forward_pre_hook(hook)


def _prepare_flex_masks(windows, layer, args):
    """FlexAttention block masks are built here, in eager code before each layer, so compiled
    attention only reads them from the cache (kernels/flex.py); after the first step a dict hit."""
    from pithtrain.kernels.flex import prepare_masks

    x_BSD = args[0]
    prepare_masks(x_BSD.shape[1], windows, x_BSD.device)
