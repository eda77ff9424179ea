"""One `parallelize` step: a single-device model (built on meta) becomes this rank's piece.

    model = build_model(cfg.model, init=False)            # meta: no memory
    parallelize(model, dims, cfg.train, device, precision)   # in place, the fixed order below
    materialize(model, build_model(cfg.model, init=False), device, cfg.train.seed)  # block by block

(pithtrain/build.py's build_run runs these for train.py, the bench, calibration and the plan.)

Order (each step relies on the previous ones):
  1. expert parallel   routed-expert weights become DTensors sharded by expert (dim 0) over the
                       ep mesh (size 1 when ep=1, so experts always live on their own mesh), and
                       each MoE block's `dispatcher` becomes the all-to-all one (dims.ep_dispatch:
                       ep > 1, or one GPU on the FSDP path).
  2. context parallel  each attention module's `attention` call (models.common.attention; a
                       variant's own is refused before, by build.check_run) becomes ContextParallelAttention,
                       each MoE block's `balance.stats_sum` an all-reduce over the cp ranks.
  3. activation checkpointing, 4. compile   (pithtrain/compile.py; module names unchanged).
  5. FSDP2             routed experts first, on the expert mesh (edp, efsdp) with Shard(1): split
                       by their input width, because dim 0 is already split by ep and E/ep need
                       not divide by efsdp; then each decoder layer, then the root (embedding,
                       final norm, LM head), on the dense mesh (dp, fsdp*cp). HSDP: replicated
                       over dp, sharded over fsdp*cp. When each rank's experts are its own
                       (dims.experts_alone: efsdp = edp = 1, e.g. fsdp=8 ep=8) FSDP leaves them
                       out (ignored_params): it would gather and reduce-scatter them over one
                       rank, a cast and two copies per micro-batch; they take the path of one
                       GPU instead (their bf16 copy, in-place weight gradients).

Mixed precision (the run's precision.Precision, decided once; its fsdp_policy() is FSDP2's
MixedPrecisionPolicy): with a bf16 compute dtype (CUDA's default) parameters are all-gathered in
bf16 and gradients reduce-scattered in `train.reduce_dtype` (float32 by default); the sharded
parameters FSDP keeps, and so AdamW's master weights and moments, stay float32. Half the
all-gather bytes of a float32 gather, and no autocast copies of the gathered weights held for
backward. float32 compute (CPU, parity tests) gathers float32. Without FSDP (and for experts FSDP
leaves out) the same numbers come from the precision's bf16 copies (precision.WeightCopies: one
copy per optimizer step, float32 gradient accumulation), which the train step enters around its
micro-batches.

Gathers kept (`precision.keep`: no pipeline, and the memory plan fits it, plan.py): each decoder
layer's FSDP unit neither reshards after forward nor after backward, so its dense parameters are
gathered once, at the step's first forward, and stay for every micro-batch's forward and backward
until precision.weights reshards them at the step's end (before the optimizer changes the
shards); the routed experts' own units reshard as before. Without a pipeline each layer also
issues the next layer's gather as it starts (forward), the previous one's in backward. With
train.state=lean the sharded parameters are bf16 already: the gathers cast nothing.

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

from pithtrain.compile import apply_activation_checkpoint, apply_compile, compiles
from pithtrain.distributed.context_parallel import ContextParallelAttention, ContextParallelSum
from pithtrain.distributed.expert_parallel import ExpertParallelDispatcher
from pithtrain.distributed.parallel_dims import ParallelDims
from pithtrain.models import to_empty
from pithtrain.models.balance import Balance
from pithtrain.models.common import GroupedExperts, Rotary, attention, decoder_layers
from pithtrain.models.init import init_block_seeded, model_blocks


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """Modules following the MoE protocol: `.experts` (GroupedExperts) and `.dispatcher`."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "experts", None), GroupedExperts) and hasattr(m, "dispatcher")]


# ---------------------------------------------------------------------------------------------
# The step


def parallelize(model: nn.Module, dims: ParallelDims, train_cfg, device: torch.device, precision) -> nn.Module:
    """Apply EP -> CP -> activation checkpointing -> compile -> FSDP to `model` in place, FSDP with
    the run's precision (precision.Precision.fsdp_policy). A variant's own attention call under
    context parallel was refused before (build.check_run)."""
    if dims.fsdp_enabled:
        for m in moe_blocks(model):
            shard_experts(m.experts, dims)
            if dims.ep_dispatch:
                m.dispatcher = ExpertParallelDispatcher(dims.ep_group, dims.ep_rank, dims.ep,
                                                        m.experts.num_experts, fused=m.dispatcher.fused)
    if dims.cp_enabled:
        cp_attention = ContextParallelAttention(dims.cp_group, dims.cp_rank, dims.cp)
        cp_sum = ContextParallelSum(dims.cp_group)
        for m in model.modules():
            call = getattr(m, "attention", None)
            if attention in (call, getattr(call, "func", None)):  # the reference or its kernels (use_kernels)
                m.attention = cp_attention
            if isinstance(m, Balance):
                m.stats_sum = cp_sum
    apply_activation_checkpoint(model, train_cfg.activation_checkpoint)
    if compiles(train_cfg, device):
        apply_compile(model)
    if dims.fsdp_enabled:
        apply_fsdp(model, dims, precision)
    return model


def shard_experts(experts: GroupedExperts, dims: ParallelDims):
    """Stacked expert tensors (E, ...) -> DTensors Shard(0) over the ep mesh: this rank keeps
    experts [ep_rank*E/ep, (ep_rank+1)*E/ep). Works on meta tensors (no data moves)."""
    ep_mesh = dims.expert_mesh["ep"]
    for name, p in list(experts.named_parameters(recurse=False)):
        dt = distribute_tensor(p.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
        setattr(experts, name, nn.Parameter(dt, requires_grad=p.requires_grad))


def apply_fsdp(model: nn.Module, dims: ParallelDims, precision):
    mp = precision.fsdp_policy()
    dense_mesh = dims.dense_mesh  # (dp, fsdp_cp): HSDP, a size-1 dp replicates nothing
    expert_mesh = dims.expert_mesh["edp", "efsdp"]
    alone, layers = set(), []  # experts FSDP leaves out (dims.experts_alone): their own rank's, whole;
    for layer in decoder_layers(model):  # their bf16 copy is the precision's (copy="experts")
        for m in moe_blocks(layer):
            if dims.experts_alone:
                alone |= set(m.experts.parameters())
            else:
                fully_shard(m.experts, mesh=expert_mesh, shard_placement_fn=lambda p: Shard(1), mp_policy=mp)
        fully_shard(layer, mesh=dense_mesh, mp_policy=mp, ignored_params=alone & set(layer.parameters()),
                    reshard_after_forward=not precision.keep)
        layers.append(layer)
    fully_shard(model, mesh=dense_mesh, mp_policy=mp, ignored_params=alone)
    if precision.keep:  # gathered at the step's first forward, resharded by precision.weights on exit
        for layer in layers:
            layer.set_reshard_after_backward(False, recurse=False)
        precision.kept[:] = layers
    if not dims.pp_enabled:  # the next layer's gather issued as a layer starts (the pipeline drives its own)
        for a, b in zip(layers, layers[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    gloo = dist.get_backend() == "gloo"
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum: see the module docstring
            if gloo:
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


# ---------------------------------------------------------------------------------------------
# Materialise and initialise


@torch.no_grad()
def materialize(model: nn.Module, meta_model: nn.Module, device: torch.device, seed: int,
                draws_on: torch.device = torch.device("cpu")):
    """Allocate this rank's pieces (to_empty) and initialise them as one process would.

    `meta_model` is the whole model on the meta device (no memory). Block by block
    (models.init.model_blocks: embedding, each layer, final norm, head) for the blocks this rank holds,
    its meta twin is allocated on `draws_on` in fp32, initialised by the family's `init_block` under
    the block's own seed (models.init.init_block_seeded: what `init_weights` does in one process), and
    each parameter's slice for this rank is copied in; the twin is freed before the next block.
    Memory: one block at a time (a DeepSeek-V2-Lite MoE layer is ~2.3 GB in fp32), not the whole
    model per rank. The draws come from the CPU generator by default, so every layout on every
    device starts from the same weights (train.py materialises one process this way too); the bench
    draws on the GPU (build.build_run's `draws`). A tied LM head stays tied (models.to_empty)."""
    to_empty(model, device)
    twins = dict(model_blocks(meta_model))
    for name, block in model_blocks(model):
        twin = twins[name]
        twin.to_empty(device=draws_on)
        init_block_seeded(twin, name, meta_model.init_block, seed)
        _copy_block(name, twin, block)
        twin.to_empty(device="meta")  # the CPU block is unreferenced now: freed before the next


def _copy_block(name: str, twin: nn.Module, block: nn.Module):
    """Copy an initialised whole block into this rank's block (its slice of each DTensor)."""
    for pname, p in block.named_parameters():
        src = twin.get_parameter(pname)
        if isinstance(p, DTensor):
            src = distribute_tensor(src.detach(), p.device_mesh, p.placements, src_data_rank=None)
            src, p = src.to_local(), p.to_local()
        assert p.shape == src.shape, (f"{name}.{pname}", p.shape, src.shape)
        p.copy_(src)
    for bname, buf in block.named_buffers():
        buf.copy_(twin.get_buffer(bname))
    for mname, m in block.named_modules():
        if isinstance(m, Rotary):
            m.mscale = twin.get_submodule(mname).mscale  # a float set by reset_parameters, not a buffer
