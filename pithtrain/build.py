"""One build path: a run's checks, then its model, kernels, layout, precision and optimizer, made the
same way for train.py, the benchmark, calibration (scripts/calibrate.py) and the memory plan.

    dims = check_run(cfg, device, world_size, rank)   # every check that needs the layout or the device
    dims.init(device, cfg.parallel.timeout_s)          # the process groups (train.py)
    run = build_run(cfg, device, dims)                  # the steps below, in order

    precision    Precision.of(recipe, device, layout): compute dtype, training state, FSDP policy, bf16
                 copies, FSDP layers kept gathered (precision.py)
    kernels      kernels.configure from the recipe and the run's facts; common.use_kernels binds them
    prune        a pipeline rank keeps its stages' layers (distributed/pipeline.py), on the meta device
    parallelize  EP -> CP -> activation checkpointing -> compile -> FSDP (distributed/parallelize.py)
    weights      train.init_from's Hugging Face tensors (each rank reads its slices: checkpoint/hf.py),
                 else the seeded block-by-block init (parallelize.materialize); none on the meta
                 device, where the memory plan builds a rank's model for its shapes
    state        train.state=lean: the float32 weights split into bf16 parameters and their low
                 halves (precision.LeanState.convert)
    optimizer    AdamW on the masters (kernels/adamw.py or torch's; kernels/adamw.py's for lean), the LR schedule
    runner       a pipeline rank's executor (distributed/pipeline.py)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from torch import nn

from pithtrain import kernels
from pithtrain.checkpoint.hf import load_hf_into
from pithtrain.config import Config, ConfigError
from pithtrain.distributed import pipeline
from pithtrain.distributed.parallel_dims import ParallelDims
from pithtrain.distributed.parallelize import materialize, parallelize
from pithtrain.models import build_model
from pithtrain.models.common import attention, use_kernels
from pithtrain.precision import Precision

# ---------------------------------------------------------------------------------------------
# The checks


def check_run(cfg: Config, device: torch.device | None, world_size: int, rank: int = 0, plan: dict | None = None
              ) -> ParallelDims:
    """Every check of a run that needs its resolved layout (plan.resolve) or its device, in one
    place, before any process group or model exists; each a ConfigError of one line naming the key
    and the way out. The recipe's sections were checked when it was loaded (each section's
    `validate`; config._cross_checks: the sections against each other and the data files). Here:
    the layout against the world size and the model (ParallelDims.validate), the features a layout
    cannot run, what the device cannot run, and on CUDA the memory plan (`plan`, plan.resolve's).
    `device` None: the launcher's check before torchrun (train.py --check), the layout's checks only."""
    dims = ParallelDims.from_config(cfg, world_size, rank)

    def fail(key, msg):
        raise ConfigError(f"{cfg.source}: {key}: {msg}")

    if cfg.data.document_mask and (dims.cp > 1 or dims.pp > 1):
        fail("data.document_mask", f"not supported with {'parallel.cp > 1' if dims.cp > 1 else 'parallel.pp > 1'} "
                                   "(set data.document_mask=false or use fsdp / dp / ep)")
    if cfg.train.eval_every and dims.pp > 1:
        fail("train.eval_every", "evaluation is not supported with parallel.pp > 1 (set train.eval_every=0)")
    if dims.cp_enabled:  # context parallel replaces models.common.attention only
        for name, m in build_model(cfg.model, init=False).named_modules():
            call = getattr(m, "attention", None)
            if call is not None and call is not attention:  # a variant's own sees only its chunk's keys
                fail(f"parallel.cp={dims.cp}", f"{name}.attention is {getattr(call, '__qualname__', call)}, "
                     "not models.common.attention, the one call context parallel replaces; give it a "
                     "context-parallel form in distributed/context_parallel.py or set parallel.cp=1")
    if cfg.train.fp8 and device is not None:
        if device.type != "cuda":
            fail("train.fp8", "FP8 training needs a Hopper or Blackwell GPU; this run is on CPU (set train.fp8=false)")
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            fail("train.fp8", f"FP8 GEMMs need FP8 tensor cores (compute capability 8.9+); "
                              f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]} (set train.fp8=false)")
        if not kernels.HAVE_TRITON or cfg.train.kernels != "auto":
            fail("train.fp8", "the FP8 GEMMs are Triton kernels; they need triton installed and train.kernels=auto")
    if cfg.train.state == "lean" and Precision.of(cfg.train, device, dims).compute != torch.bfloat16:
        fail("train.state", "lean keeps bf16 weights and needs bf16 compute; this run computes in float32 "
                            "(on CPU set train.dtype=bfloat16, or set train.state=float32)")
    if plan is not None and not plan["fits"]:
        raise ConfigError(plan["refusal"])
    return dims


# ---------------------------------------------------------------------------------------------
# The build


@dataclass
class Run:
    """A built run: what the train step (train.train_step), evaluation and the checkpointer use."""
    cfg: Config
    dims: ParallelDims
    device: torch.device
    precision: Precision
    use: dict  # the kernel choice (kernels.configure)
    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
    chunks: list | None = None  # a pipeline rank's chunks (schedule.rank_chunks)
    runner: pipeline.PipelineRunner | None = None


def build_run(cfg: Config, device: torch.device, dims: ParallelDims, *, state: str | None = None,
              keep: bool | None = None, off: tuple = (), draws: str = "cpu") -> Run:
    """The run of `cfg` on `device` in layout `dims` (checked: check_run; process groups and meshes
    made when distributed): the module docstring's steps. `state`: the training state (precision.
    STATES; train.state unless given; the bench's "bf16" casts the weights to bf16 after they are
    drawn); `keep`: whether FSDP keeps the dense layers gathered across a step (the memory plan's
    answer, its "keep"; None: wherever it applies, Precision.of); `off`: kernels kept
    on their reference (the bench's no-NAME); `draws`: where the init's random draws are made, "cpu"
    (every layout and device starts from the same weights) or "device" (faster: the bench, whose
    timing does not depend on the values)."""
    t = cfg.train
    precision = Precision.of(t, device, dims, state, keep)
    use = kernels.configure(t.kernels, device, fp8=t.fp8, bf16=precision.compute == torch.bfloat16,
                            fsdp=dims.fsdp_enabled, experts_alone=dims.experts_alone, cp=dims.cp_enabled, off=off)
    model = use_kernels(build_model(cfg.model, init=False), use, precision.sink)  # meta until the weights
    model.train()
    chunks = pipeline.prepare(model, cfg, dims) if dims.pp_enabled else None
    parallelize(model, dims, t, device, precision)
    run = Run(cfg, dims, device, precision, use, model, chunks=chunks)
    if device.type == "meta":  # the memory plan: shapes only
        return run
    if t.init_from:  # each rank reads only the slices it holds (checkpoint/hf.py)
        try:
            load_hf_into(model, t.init_from, device)
        except (OSError, ValueError, KeyError, SafetensorError) as e:  # each names the file
            raise ConfigError(f"train.init_from: {' '.join(str(e).split())}") from None
    else:  # block by block, each block from its own seed: 1 GPU == N GPUs
        materialize(model, build_model(cfg.model, init=False), device, t.seed,
                    draws_on=device if draws == "device" else torch.device("cpu"))
    if precision.state == "bf16":
        for p in model.parameters():  # buffers (RoPE) stay float32
            p.data = p.data.to(torch.bfloat16)
    if precision.lean is not None:
        precision.lean.convert(model)
    run.optimizer = build_optimizer(model, cfg, device, use, precision.copies, precision.lean)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lr_lambda(cfg))
    if chunks:
        run.runner = pipeline.make_runner(model, chunks, cfg, dims, device, precision)
    return run


def build_optimizer(model: nn.Module, cfg: Config, device: torch.device, use: dict | None = None, copies=None,
                    lean=None):
    """AdamW on the masters; no weight decay on norms, biases and 1-D tensors. `lean` (the run's
    precision.LeanState) or `use` (kernels.configure) adamw: kernels/adamw.py's (the lean state's,
    on CPU too; or the Triton step, which rewrites the float32 masters' bf16 `copies` in its pass),
    else torch's, fused on CUDA."""
    decay, no_decay = [], []
    for p in {id(p): p for p in model.parameters() if p.requires_grad}.values():
        (decay if p.ndim >= 2 else no_decay).append(p)
    t = cfg.train
    groups = [{"params": decay, "weight_decay": t.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if lean is not None or (use and use["adamw"]):
        from pithtrain.kernels.adamw import AdamW

        return AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, copies=copies, lean=lean)
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                             fused=device.type == "cuda")


def lr_lambda(cfg: Config):
    """The LR factor of each step: linear warmup to train.lr over warmup_steps, then held until the
    decay starts (at once for cosine and linear; for wsd at train.steps minus its decay_ratio share;
    never for constant), then falling to min_lr_ratio at train.steps along the decay's shape. A
    function of the recipe alone: a resumed run recomputes it (checkpoint/dcp.py), so a longer
    train.steps moves a wsd decay later (a longer stable phase) and stretches a cosine one."""
    t = cfg.train
    shape = {"cosine": "cosine", "linear": "linear"}.get(t.lr_schedule, t.decay_type)
    start = {"cosine": t.warmup_steps, "linear": t.warmup_steps, "constant": t.steps}.get(
        t.lr_schedule, max(t.warmup_steps, t.steps - round(t.decay_ratio * t.steps)))

    def f(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if step < start:
            return 1.0
        p = min((step - start) / max(t.steps - start, 1), 1.0)
        left = {"linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p)), "sqrt": 1 - math.sqrt(p)}[shape]
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * left

    return f
