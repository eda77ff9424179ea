"""One `parallelize` step: a single-device model (built on meta) becomes this rank's piece.

    model = build_model(cfg.model, device, init=False)   # meta: no memory
    parallelize(model, dims, cfg.train, device)           # in place, the fixed order below
    materialize(model, cfg, device)                       # to_empty + the single-process init

Order (each step relies on the previous ones):
  1. expert parallel   routed-expert weights become DTensors sharded by expert (dim 0) over the
                       ep mesh (size 1 when ep=1, so experts always live on their own mesh), and
                       each MoE block's `dispatcher` becomes the all-to-all one (ep > 1).
  2. context parallel  each attention module's `attention` call becomes ContextParallelAttention,
                       each MoE block's `load_balance_loss` the one with whole-sequence statistics.
  3. activation checkpointing, 4. compile   (pithtrain/compile.py; module names unchanged).
  5. FSDP2             routed experts first, on the expert mesh (edp, efsdp) with Shard(1): split
                       by their input width, because dim 0 is already split by ep and E/ep need
                       not divide by efsdp; then each decoder layer, then the root (embedding,
                       final norm, LM head), on the dense mesh (dp, fsdp*cp). HSDP: replicated
                       over dp, sharded over fsdp*cp.

Gradient reduction is a SUM (divide factor 1): the trainer divides the loss by the global target
count, so summing every rank's gradient gives the single-process gradient. Experts need this:
their gradient already sums the tokens of the whole ep group (through the all-to-all), and a
mean over efsdp would divide by the wrong count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from pithtrain.compile import apply_activation_checkpoint, apply_compile
from pithtrain.distributed.context_parallel import ContextParallelAttention, ContextParallelLoadBalanceLoss
from pithtrain.distributed.expert_parallel import ExpertParallelDispatcher
from pithtrain.distributed.parallel_dims import ParallelDims
from pithtrain.models.common import GroupedExperts, Rotary, attention, load_balance_loss


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """Modules following the MoE protocol: `.experts` (GroupedExperts) and `.dispatcher`."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "experts", None), GroupedExperts) and hasattr(m, "dispatcher")]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    layers = model.layers
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


# ---------------------------------------------------------------------------------------------
# The step


def parallelize(model: nn.Module, dims: ParallelDims, train_cfg, device: torch.device) -> nn.Module:
    """Apply EP -> CP -> activation checkpointing -> compile -> FSDP to `model` in place."""
    if dims.fsdp_enabled:
        for m in moe_blocks(model):
            shard_experts(m.experts, dims)
            if dims.ep_enabled:
                m.dispatcher = ExpertParallelDispatcher(dims.ep_group, dims.ep_rank, dims.ep,
                                                        m.experts.num_experts)
    if dims.cp_enabled:
        cp_attention = ContextParallelAttention(dims.cp_group, dims.cp_rank, dims.cp)
        cp_balance = ContextParallelLoadBalanceLoss(dims.cp_group)
        for m in model.modules():
            if getattr(m, "attention", None) is attention:
                m.attention = cp_attention
            if getattr(m, "load_balance_loss", None) is load_balance_loss:
                m.load_balance_loss = cp_balance
    apply_activation_checkpoint(model, train_cfg.activation_checkpoint)
    if train_cfg.compile and device.type == "cuda":
        apply_compile(model)
    if dims.fsdp_enabled:
        apply_fsdp(model, dims)
    return model


def shard_experts(experts: GroupedExperts, dims: ParallelDims):
    """Stacked expert tensors (E, ...) -> DTensors Shard(0) over the ep mesh: this rank keeps
    experts [ep_rank*E/ep, (ep_rank+1)*E/ep). Works on meta tensors (no data moves)."""
    ep_mesh = dims.expert_mesh["ep"]
    for name, p in list(experts.named_parameters(recurse=False)):
        dt = distribute_tensor(p.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
        setattr(experts, name, nn.Parameter(dt, requires_grad=p.requires_grad))


def apply_fsdp(model: nn.Module, dims: ParallelDims):
    dense_mesh = dims.dense_mesh  # (dp, fsdp_cp): HSDP, a size-1 dp replicates nothing
    expert_mesh = dims.expert_mesh["edp", "efsdp"]
    for layer in decoder_layers(model):
        for m in moe_blocks(layer):
            fully_shard(m.experts, mesh=expert_mesh, shard_placement_fn=lambda p: Shard(1))
        fully_shard(layer, mesh=dense_mesh)
    fully_shard(model, mesh=dense_mesh)
    gloo = dist.get_backend() == "gloo"
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum: see the module docstring
            if gloo:
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


# ---------------------------------------------------------------------------------------------
# Materialise and initialise


@torch.no_grad()
def materialize(model: nn.Module, full_model: nn.Module, device: torch.device):
    """Allocate this rank's pieces (to_empty) and fill them from `full_model`, an initialised
    single-device model (train.py builds it on CPU under the run's seed, so every rank makes the
    same RNG draws as one process would, and parity with one process is exact). Each rank keeps
    its slice of every parameter. Costs one full fp32 copy in host memory per rank while it
    runs; for models that do not fit, start from a checkpoint (train.init_from). The draws come
    from the CPU generator: a multi-GPU run starts where a one-process CPU run does, not where a
    one-GPU run (whose init draws on the GPU) does."""
    model.to_empty(device=device)
    full_params = dict(full_model.named_parameters())
    for name, p in model.named_parameters():
        src = full_params[name]
        if isinstance(p, DTensor):
            src = distribute_tensor(src.detach(), p.device_mesh, p.placements, src_data_rank=None)
            src, p = src.to_local(), p.to_local()
        assert p.shape == src.shape, (name, p.shape, src.shape)
        p.copy_(src)
    full_buffers = dict(full_model.named_buffers())
    for name, b in model.named_buffers():
        b.copy_(full_buffers[name])
    full_modules = dict(full_model.named_modules())
    for name, m in model.named_modules():
        if isinstance(m, Rotary):
            m.mscale = full_modules[name].mscale  # a float set by reset_parameters, not a buffer
