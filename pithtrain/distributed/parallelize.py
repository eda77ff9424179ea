"""One `parallelize` step: a single-device model (built on meta) becomes this rank's piece.

    model = build_model(cfg.model, device, init=False)   # meta: no memory
    parallelize(model, dims, cfg.train, device)           # in place, the fixed order below
    materialize(model, build_model(cfg.model, init=False), device, cfg.train.seed)  # block by block

Order (each step relies on the previous ones):
  1. expert parallel   routed-expert weights become DTensors sharded by expert (dim 0) over the
                       ep mesh (size 1 when ep=1, so experts always live on their own mesh), and
                       each MoE block's `dispatcher` becomes the all-to-all one (ep > 1).
  2. context parallel  each attention module's `attention` call (models.common.attention; a
                       variant's own is refused, naming the module) becomes ContextParallelAttention,
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
                       GPU instead (`bf16_weights`, in-place weight gradients).

Mixed precision (FSDP2 MixedPrecisionPolicy, `mp_policy`): with a bf16 compute dtype (CUDA's
default) parameters are all-gathered in bf16 and gradients reduce-scattered in `train.reduce_dtype`
(float32 by default); the sharded parameters FSDP keeps, and so AdamW's master weights and
moments, stay float32. Half the all-gather bytes of a float32 gather, and no autocast copies of
the gathered weights held for backward. float32 compute (CPU, parity tests) gathers float32.
Without FSDP (and for experts FSDP leaves out) the same numbers come from `bf16_weights` (one bf16
copy per optimizer step, float32 gradient accumulation), which the train step enters around its
micro-batches.

Gradient reduction is a SUM (divide factor 1): the trainer divides the loss by the global target
count, so summing every rank's gradient gives the single-process gradient. Experts need this:
their gradient already sums the tokens of the whole ep group (through the all-to-all), and a
mean over efsdp would divide by the wrong count.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from pithtrain.compile import apply_activation_checkpoint, apply_compile
from pithtrain.config import ConfigError
from pithtrain.distributed.context_parallel import ContextParallelAttention, ContextParallelSum
from pithtrain.distributed.expert_parallel import ExpertParallelDispatcher
from pithtrain.distributed.parallel_dims import ParallelDims
from pithtrain.models import to_empty
from pithtrain.models.balance import Balance
from pithtrain.models.common import GroupedExperts, Rotary, attention, local, decoder_layers
from pithtrain.models.init import init_block_seeded, model_blocks


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """Modules following the MoE protocol: `.experts` (GroupedExperts) and `.dispatcher`."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "experts", None), GroupedExperts) and hasattr(m, "dispatcher")]


# ---------------------------------------------------------------------------------------------
# The step


def parallelize(model: nn.Module, dims: ParallelDims, train_cfg, device: torch.device) -> nn.Module:
    """Apply EP -> CP -> activation checkpointing -> compile -> FSDP to `model` in place."""
    if dims.fsdp_enabled:
        for m in moe_blocks(model):
            shard_experts(m.experts, dims)
            if dims.ep_enabled:
                m.dispatcher = ExpertParallelDispatcher(dims.ep_group, dims.ep_rank, dims.ep,
                                                        m.experts.num_experts, fused=m.dispatcher.fused)
    if dims.cp_enabled:
        cp_attention = ContextParallelAttention(dims.cp_group, dims.cp_rank, dims.cp)
        cp_sum = ContextParallelSum(dims.cp_group)
        for name, m in model.named_modules():
            call = getattr(m, "attention", None)
            if attention in (call, getattr(call, "func", None)):  # the reference or its kernels (use_kernels)
                m.attention = cp_attention
            elif call is not None:  # a variant's own: on local chunks it would see only its chunk's keys
                raise ConfigError(f"parallel.cp={dims.cp}: {name}.attention is {getattr(call, '__qualname__', call)}, "
                                  "not models.common.attention, the one call context parallel replaces; "
                                  "give it a context-parallel form in distributed/context_parallel.py or set parallel.cp=1")
            if isinstance(m, Balance):
                m.stats_sum = cp_sum
    apply_activation_checkpoint(model, train_cfg.activation_checkpoint)
    if train_cfg.compile and device.type == "cuda":
        apply_compile(model)
    if dims.fsdp_enabled:
        apply_fsdp(model, dims, mp_policy(train_cfg, device))
    return model


def mp_policy(train_cfg, device: torch.device) -> MixedPrecisionPolicy:
    """bf16 gathers when the run computes under bf16 autocast (CUDA, train.dtype auto or
    bfloat16: train.compute_dtype), float32 otherwise; gradients reduced in train.reduce_dtype."""
    bf16 = device.type == "cuda" and train_cfg.dtype in ("auto", "bfloat16")
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else torch.float32,
                                reduce_dtype=getattr(torch, train_cfg.reduce_dtype))


def uses_bf16_weights(dims: ParallelDims, autocast) -> bool:
    """bf16 autocast without FSDP (one GPU, or pipeline stages alone: ep and cp imply FSDP), or with
    experts FSDP leaves out (dims.experts_alone): those weights come from `bf16_weights`; FSDP's
    MixedPrecisionPolicy gathers the rest in bf16 itself."""
    return (isinstance(autocast, torch.autocast) and autocast.fast_dtype == torch.bfloat16
            and (not dims.fsdp_enabled or dims.experts_alone))


@contextlib.contextmanager
def bf16_weights(model: nn.Module, on: bool = True):
    """The numbers of FSDP's MixedPrecisionPolicy without FSDP: inside the `with` (one optimizer
    step) every float32 parameter is replaced in its module by a bf16 leaf holding its value, and
    each micro-batch's bf16 gradient is added into the float32 master's .grad as autograd
    accumulates it (float32 accumulation, as FSDP's float32 reduction; kernels/wgrad.py writes the
    gradients it makes there directly); on exit the modules hold the masters again, so clip,
    AdamW, checkpoints and export see only float32. Plain autocast would cast every weight in each
    micro-batch's forward and recompute and cast and accumulate each gradient on its own: 20% of a
    4-layer Qwen3 step at 8 micro-batches (docs/perf-notes.md).

    The bf16 leaf is made once and kept on the master (`p.bf16`; it points back weakly, `b.master`);
    on entry it is refreshed by a cast unless kernels/adamw.py already wrote the updated value into
    it in its pass, which it marks with the master's version and storage (`p.bf16_written`): any
    later in-place change through torch moves the version on, a new tensor the storage, and the
    cast runs again. A write through `p.data`, which torch does not count, is not seen: change
    masters between steps through torch ops (as checkpoint loading does). on=False: nothing changes
    (float32 runs, FSDP)."""
    if not on:
        yield
        return
    fsdp = isinstance(model, FSDPModule)  # then only the experts FSDP left out (apply_fsdp)
    slots = [(mod, name, p) for mod in model.modules() for name, p in mod._parameters.items()
             if p is not None and p.dtype == torch.float32 and (not fsdp or getattr(mod, "outside_fsdp", False))]
    for _, _, p in slots:  # tied parameters share one copy
        b, local = getattr(p, "bf16", None), local(p)  # a DTensor master (experts): its local block
        if (b is None or b.shape != local.shape or b.device != p.device or b.requires_grad != p.requires_grad
                or b.master() is not p):
            b = p.bf16 = nn.Parameter(local.detach().to(torch.bfloat16), requires_grad=p.requires_grad)
            b.master = weakref.ref(p)  # where _into_master, and kernels/wgrad.py directly, add its gradients
            if p.requires_grad:
                b.register_post_accumulate_grad_hook(_into_master)
        elif getattr(p, "bf16_written", None) != (p._version, p.data_ptr()):
            with torch.no_grad():
                b.copy_(local)
        p.bf16_written = (p._version, p.data_ptr())  # current: a tied parameter's second slot casts nothing
    for mod, name, p in slots:
        mod._parameters[name] = p.bf16
    try:
        yield
    finally:
        for mod, name, p in slots:
            mod._parameters[name] = p


def _into_master(b: torch.Tensor) -> None:
    if b.grad is None:  # kernels/wgrad.py added this micro-batch's gradient into master.grad itself
        return
    master = b.master()
    if master.grad is None:
        g = b.grad.to(master.dtype)
        master.grad = (DTensor.fromlocal(g, master.device_mesh, master.placements, run_check=False,
                                          shape=master.shape, stride=master.stride())
                       if isinstance(master, DTensor) else g)
    else:
        local(master.grad).add_(b.grad)
    b.grad = None


def shard_experts(experts: GroupedExperts, dims: ParallelDims):
    """Stacked expert tensors (E, ...) -> DTensors Shard(0) over the ep mesh: this rank keeps
    experts [ep_rank*E/ep, (ep_rank+1)*E/ep). Works on meta tensors (no data moves)."""
    ep_mesh = dims.expert_mesh["ep"]
    for name, p in list(experts.named_parameters(recurse=False)):
        dt = distribute_tensor(p.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
        setattr(experts, name, nn.Parameter(dt, requires_grad=p.requires_grad))


def apply_fsdp(model: nn.Module, dims: ParallelDims, mp: MixedPrecisionPolicy):
    dense_mesh = dims.dense_mesh  # (dp, fsdp_cp): HSDP, a size-1 dp replicates nothing
    expert_mesh = dims.expert_mesh["edp", "efsdp"]
    alone = set()  # experts FSDP leaves out (dims.experts_alone): their own rank's, whole
    for layer in decoder_layers(model):
        for m in moe_blocks(layer):
            if dims.experts_alone:
                m.experts.outside_fsdp = True  # bf16_weights gives them their bf16 copy
                alone |= set(m.experts.parameters())
            else:
                fully_shard(m.experts, mesh=expert_mesh, shard_placement_fn=lambda p: Shard(1), mp_policy=mp)
        fully_shard(layer, mesh=dense_mesh, mp_policy=mp, ignored_params=alone & set(layer.parameters()))
    fully_shard(model, mesh=dense_mesh, mp_policy=mp, ignored_params=alone)
    gloo = dist.get_backend() == "gloo"
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum: see the module docstring
            if gloo:
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


# ---------------------------------------------------------------------------------------------
# Materialise and initialise


@torch.no_grad()
def materialize(model: nn.Module, meta_model: nn.Module, device: torch.device, seed: int):
    """Allocate this rank's pieces (to_empty) and initialise them as one process would.

    `meta_model` is the whole model on the meta device (no memory). Block by block
    (models.init.model_blocks: embedding, each layer, final norm, head) for the blocks this rank holds,
    its meta twin is allocated on the CPU in fp32, initialised by the family's `init_block` under
    the block's own seed (models.init.init_block_seeded: what `init_weights` does in one process), and
    each parameter's slice for this rank is copied in; the twin is freed before the next block.
    Host memory: one block at a time (a DeepSeek-V2-Lite MoE layer is ~2.3 GB in fp32), not the
    whole model per rank. The draws come from the CPU generator, so every layout on every device
    starts from the same weights (train.py materialises one process this way too). A tied LM head
    stays tied (models.to_empty)."""
    to_empty(model, device)
    twins = dict(model_blocks(meta_model))
    for name, block in model_blocks(model):
        twin = twins[name]
        twin.to_empty(device="cpu")
        init_block_seeded(twin, name, meta_model.init_block, seed)
        _copy_block(name, twin, block)
        twin.to_empty(device="meta")  # the CPU block is unreferenced now: freed before the next


def _copy_block(name: str, twin: nn.Module, block: nn.Module):
    """Copy an initialised whole block into this rank's block (its slice of each DTensor)."""
    src_params = dict(twin.named_parameters())
    for pname, p in block.named_parameters():
        src = src_params[pname]
        if isinstance(p, DTensor):
            src = distribute_tensor(src.detach(), p.device_mesh, p.placements, src_data_rank=None)
            src, p = src.tolocal(), p.tolocal()
        assert p.shape == src.shape, (f"{name}.{pname}", p.shape, src.shape)
        p.copy_(src)
    src_buffers = dict(twin.named_buffers())
    for bname, buf in block.named_buffers():
        buf.copy_(src_buffers[bname])
    src_modules = dict(twin.named_modules())
    for mname, m in block.named_modules():
        if isinstance(m, Rotary):
            m.mscale = src_modules[mname].mscale  # a float set by reset_parameters, not a buffer
