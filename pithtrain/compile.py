"""Activation checkpointing and torch.compile for the decoder layers, applied in place.

Order (parallelize's contract, pithtrain/distributed/parallelize.py): expert parallel ->
context parallel -> `apply_activation_checkpoint` -> `apply_compile` -> FSDP. Both walk the
decoder layers (`common.decoder_layers`: all of them, or a pipeline stage's) and the plain
attributes every family has (`self_attn`, `input_layernorm`, `post_attention_layernorm`, `mlp`,
and inside a MoE block `route`, `experts`, `dispatcher`, optional `shared_experts`).

What is compiled (fullgraph=True: a graph break is an error, not a silent slow path):
  each layer's attention phase as one graph (`DecoderLayer.attend`: the input norm, attention with
  its projections, RoPE and q/k norms, the residual add and the MLP's input norm), a dense MLP
  layer's `mlp`, and inside a MoE block the router with its balancing unit's `observe` (load count
  and loss: a dozen small operations) as one graph (`common.route_and_observe`, set as the block's
  `routing`; under context parallel, whose statistics take an all-reduce, only the router), the
  local dispatcher's index plan (`common.dispatch_plan`: expert order, counts, inverse order) and
  any other expert-free child (shared experts).
  The permutation, the grouped expert GEMMs and combine stay eager: they already run as a few
  large kernels (grouped GEMM, Triton permute/SwiGLU) that a compiler would not improve.

Activation checkpointing (`train.activation_checkpoint`), per decoder layer, least memory last:
  "none"       autograd keeps what each operation saves (compiled graphs: what inductor's
               partitioner keeps, which already recomputes the pointwise work inside them).
  "cheap"      keep what is expensive to make again, recompute what is cheap: the attention phase
               (`attend`) and every dense SwiGLU (a dense layer's `mlp`, shared experts) run under
               a selective checkpoint (torch.utils.checkpoint's create_selective_checkpoint_contexts)
               whose policy (`cheap_policy`) saves the outputs of the GEMMs and of the attention
               kernel (output and log-sum-exp) and recomputes the rest in backward: norms, RoPE,
               activations, casts, residual adds. The routed experts keep their dispatched rows and
               both GEMMs' outputs and recompute the activation (SwiGLU, GPT-OSS's clamp) from the
               first GEMM's output (`GroupedExperts.down` under a plain checkpoint, which stops
               recomputing when the second GEMM has saved its input, before that GEMM runs). The
               router (its softmax: 4 B x experts per token) and dispatch / combine are untouched,
               so expert parallel's all-to-all runs once. Cost: the recomputed pointwise work, a
               few percent of the layer (pithtrain/perf.py).
  "selective"  recompute only the expert computation: a MoE layer's grouped experts (and shared
               experts), a dense layer's `mlp`. The routed experts' hidden activations (top_k
               rows per token, 2F + F wide) are the largest share of a MoE layer's saved memory,
               and their recompute is one grouped-GEMM forward; attention's saved tensors, and
               the dispatched rows (the checkpoint's input), are kept. Dispatch and combine stay
               outside the checkpoint, so expert parallel's all-to-all is never run twice.
  "full"       recompute each whole decoder layer in backward (least memory, ~1/3 more compute).
What each keeps, per token, is pithtrain/plan.py's table (layer_activations), checked against
torch's saved-tensor hooks in tests/test_plan.py.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import pithtrain.kernels.fa4  # noqa: F401  (registers pithtrain::fa4_fwd, an attention kernel cheap_policy keeps)
from pithtrain.models.balance import local_sum
from pithtrain.models.common import GroupedExperts, LocalDispatcher, decoder_layers, dispatch_plan, route_and_observe


def _has_experts(m: nn.Module) -> bool:
    return any(isinstance(x, GroupedExperts) for x in m.modules())


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


# What "cheap" keeps: the outputs of GEMMs and attention kernels (every SDPA backend, FlexAttention,
# flash-attn-4); everything else in its regions is recomputed in backward.
_aten = torch.ops.aten
KEPT_OPS = frozenset([
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten._grouped_mm.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.higher_order.flex_attention, torch.ops.pithtrain.fa4_fwd.default])


def cheap_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _cheap(forward, *args, **kwargs):
    # context_fn: the selective checkpoint's context pair for one region (a fresh cache each call)
    return checkpoint(forward, *args, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, cheap_policy), **kwargs)


def apply_activation_checkpoint(model: nn.Module, mode: str) -> None:
    if mode not in ("none", "cheap", "selective", "full"):
        raise ValueError(f"activation checkpointing {mode!r}: the run's choice is made before the build "
                         "(plan.resolve chooses train.activation_checkpoint=auto)")
    if mode == "none":
        return
    for layer in decoder_layers(model):
        mlp = layer.mlp
        moe = hasattr(mlp, "dispatcher")  # a MoE block: its phases call the experts directly
        shared = getattr(mlp, "shared_experts", None)
        swiglus = ([shared] if shared is not None else []) if moe else [mlp]  # the dense SwiGLU MLPs
        if mode == "cheap":
            layer.attend = functools.partial(_cheap, layer.attend)
            for m in swiglus:
                m.forward = functools.partial(_cheap, m.forward)
            if moe:
                mlp.experts.down = functools.partial(_checkpointed, mlp.experts.down)
            continue
        if mode == "full":
            targets = [layer]
        else:  # selective: the experts' GEMMs and the dense SwiGLUs
            targets = [mlp.experts, *swiglus] if moe else swiglus
        for target in targets:
            target.forward = functools.partial(_checkpointed, target.forward)


def compiles(train_cfg, device: torch.device) -> bool:
    """Whether `train.compile` acts: on CUDA only, where parallelize applies apply_compile; on
    another device the trainer says once that it is off (train.start)."""
    return train_cfg.compile and device.type == "cuda"


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    """torch.compile(fullgraph=True) on the non-MoE parts of every layer (module identity and
    parameter names unchanged). Dynamo's recompile limits are left as they are: its modules are
    inlined, so every layer shares the graphs of the first (one per kind: attention phase, router
    with its balancing unit, dispatch plan; tests/test_kernels.py checks this at 12 layers), far
    below the default limit.
    Fewer, larger graphs also cost the host less: each compiled call pays its guards and autograd
    wrapper once, forward and backward (docs/perf-notes.md)."""
    for layer in decoder_layers(model):  # a pipeline stage holds some of them
        layer.attend = torch.compile(layer.attend, fullgraph=True, backend=backend)
        mlp = layer.mlp
        if not _has_experts(mlp):
            mlp.compile(fullgraph=True, backend=backend)
            continue
        mlp.route = torch.compile(mlp.route, fullgraph=True, backend=backend)  # evaluation; context parallel
        if mlp.balance.stats_sum is local_sum:  # context parallel's all-reduce stays eager
            mlp.routing = torch.compile(route_and_observe, fullgraph=True, backend=backend)
        if isinstance(mlp.dispatcher, LocalDispatcher):  # expert parallel's plans around its all-to-all
            mlp.dispatcher.plan = torch.compile(dispatch_plan, fullgraph=True, backend=backend)
        for sub in mlp.children():
            if not _has_experts(sub) and not isinstance(sub, nn.Linear):  # e.g. shared experts
                sub.compile(fullgraph=True, backend=backend)
