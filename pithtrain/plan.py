"""The memory plan of a run, before anything is allocated, and the automatic layout built on it.

    python -m pithtrain.plan --model qwen3-30b-a3b --gpu h100 --gpus 8 [--nodes 2] [--set k=v] [--json]
    invoke plan --model qwen3-30b-a3b --gpu h100 --gpus 8

Per rank: parameters, gradients, AdamW state, activations, communication buffers and the peak,
against the GPU's memory (pithtrain/gpus.py). `train.py` resolves its layout here (`resolve_launch`:
a new Config, the recipe's untouched; `parallel: auto` takes the fastest candidate layout whose
plan fits, auto_layout) and on CUDA refuses a layout whose plan does not fit (build.check_run).

Parameters, gradients, optimizer state: exact. The model is built on the meta device by the
run's own build (build.build_run: kernels, pipeline pruning, `parallelize`) under a fake process
group (the "fake" backend with torch's FakeStore, as TorchTitan's memory estimator does), once for
the first rank of each pipeline stage: the other ranks of a stage hold the same shapes or, with
uneven FSDP shards, smaller ones (FSDP2 pads every shard to the first rank's size). The local
shape of each parameter is this rank's share, at the bytes of the run's training state
(precision.STATES; float32: masters 4 B, gradients 4 B (FSDP reduces into the float32 sharded
gradient), AdamW's two moments 8 B).

Activations: a count of the tensors autograd keeps per token on the CUDA bf16 path (compiled
graphs, fused kernels), layer by layer (layer_activations), with c the compute bytes (2; the
residual stream is bf16 too, as every weight is: FSDP's bf16 gathers, or without FSDP the bf16
copy, precision.WeightCopies). Attention phase of H heads (K for k and v: kv heads, MLA every
head), widths d_qk, d_v:
    none, selective  its input, the residual after attention, the normalised input (every GEMM
                     reading width D shares it), each other GEMM's input (o_proj's at any width),
                     q and k as the kernel reads them, v (MLA: the GEMM output it slices), the
                     kernel's output and float32 log-sum-exp, each norm's input (per-head norms: every head) and
                     float32 statistics (4 B a row)
    cheap            its input, every GEMM's output, the kernel's output and log-sum-exp
MLP block, D wide, a MoE block of top-k A over E routed experts of width F:
    all but full     its input (c D); the router's logits (c E), ids, weights; unpermute's
                     weights and indices (and the expert ids of biased experts)
    routed experts   dispatched rows and expert outputs (2 c A D), plus [gate | up] (2 c A F,
                     none and cheap) and the activation (c A F, none); with ep > 1 these are the
                     busiest rank's (times the calibration routing's busiest-over-mean, `busiest`),
                     and the combine keeps the rows it receives back (c A D, none and cheap)
    dense SwiGLU     (a dense layer's MLP; shared experts also keep their own input, c D) width
                     F: gate, up, their product (3 c F, none), gate and up (cheap), nothing
                     (selective)
and under full each layer keeps its input (c D). Eager (train.compile false; none, selective):
each norm keeps its float32 copy (4 B a value) and its cast-back (c) where a graph keeps its
input, and a dense SwiGLU also silu(gate) (c F). tests/test_plan.py compares these, per layer and
part, with what torch's saved-tensor hooks see at tiny widths on CPU (within 3%).
One micro-batch is T = micro_batch_size * seq_len / cp tokens per rank. A GPU test
(tests/test_plan.py, marked gpu) compares the peak with torch.cuda.max_memory_allocated.

Communication buffers. FSDP2: the root's unsharded parameters (embedding, final norm, head:
FSDP keeps the root gathered between forward and backward), the current and the prefetched
layer gathered (param dtype), and one layer's unsharded gradients in the compute and reduce
dtypes (the reduce-scatter input). Where the run keeps the layers gathered across the step
(precision.keep: no pipeline), every layer's dense part gathered instead, and the root's all-gather
buffer, which FSDP2 holds until its next gather and no layer issues one ("keep_bytes"); a plan
that does not fit that way drops it first ("keep": false, and the run gathers per micro-batch).
Expert parallel: one layer's all-to-all send and receive buffers (2 c A T D).

Peak: the larger of
    end of forward   static + in-flight activations + gradients held (all of them when a step has
                     several micro-batches, else the LM head's, which the fused loss makes in the
                     forward) + one 4096-row chunk of bf16 logits + comm
    backward         static + all gradients + one layer's activations (its backward transients)
                     + the other in-flight micro-batches' activations + comm
with static = parameters + optimizer state (present from the first step on) + where the run's
precision keeps one, the bf16 copy of the weights (2 B per parameter, kept across steps) + with train.fp8 the
FP8 weight cache (2 B per unsharded expert weight element, pithtrain/kernels/fp8_linear.py) + the
cuBLAS workspaces (WORKSPACE: 32 MiB per handle on Hopper, one for the forward's thread and one
for autograd's, allocated through the caching allocator; measured on the H200). The in-flight
micro-batches come from the pipeline schedule itself (a chunk's forward holds its activations
until its weight-gradient or full backward). Not counted: the CUDA context, NCCL's buffers and
allocator fragmentation; a plan fits when its peak is at most FIT_FRACTION of the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import sys

import torch
import torch.distributed as dist
from torch import nn

from pithtrain import perf
from pithtrain.build import build_run
from pithtrain.config import LAYOUT_KEYS, Config, ConfigError, load_config
from pithtrain.distributed import pipeline, schedule
from pithtrain.distributed.parallel_dims import ParallelDims
from pithtrain.distributed.parallelize import moe_blocks
from pithtrain.gpus import GPUS, gpu_key
from pithtrain.models import build_model
from pithtrain.models.common import GroupedExperts, RMSNorm, decoder_layers, indexed_layers, local
from pithtrain.precision import Precision

GIB = 2 ** 30
FIT_FRACTION = 0.92  # the rest: CUDA context, NCCL, allocator fragmentation
LOSS_CHUNK = 4096  # rows of logits at a time (models.common.cross_entropy_sum)
WORKSPACE = 2 * 32 * 2 ** 20  # cuBLAS: 32 MiB per handle (Hopper), the forward's and autograd's threads


# ---------------------------------------------------------------------------------------------
# One rank's model on the meta device, under a fake process group


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """A process group whose collectives do nothing, so DeviceMeshes and fully_shard can be built
    for any world size in this one process. World size 1 needs none."""
    if world_size == 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("the memory plan builds a fake process group; this process already has one")
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Activations (the module docstring's table)


def layer_activations(layer: nn.Module, i: int, cfg: Config, c: int, mode: str) -> tuple[int, int]:
    """Bytes per token decoder layer i keeps for backward under activation checkpointing `mode`,
    as (attention phase, MLP block), compiled or eager (train.compile): the module docstring's table."""
    m, D = cfg.model, cfg.model.hidden_size
    if mode == "full":
        return 0, c * D  # the layer's input
    attn = layer.self_attn
    _, d_qk, d_v, H = m.attention_shapes(i)
    K = getattr(m, "num_kv_heads", H)  # the kernel's k / v heads (MLA: every head)
    linears = [x for x in attn.modules() if isinstance(x, nn.Linear)]
    core = c * H * d_v + 4 * H  # the kernel's output and float32 log-sum-exp
    if mode == "cheap":
        a = c * D + sum(c * x.out_features for x in linears) + core
    else:
        rows = {"q_norm": H, "k_norm": K}  # per-head norms; the others normalise a token's one row
        norms = [(n, x.weight.shape[0] * rows.get(n, 1)) for n, x in attn.named_modules() if isinstance(x, RMSNorm)]
        v, widths = c * K * d_v, dict(norms)
        if hasattr(attn, "kv_b_proj"):  # MLA: v and the latent's norm input are slices of their GEMMs' outputs
            v = c * attn.kv_b_proj.out_features
            norms = [(n, attn.kv_a_proj_with_mqa.out_features if n == "kv_a_layernorm" else w) for n, w in norms]
        a = (3 * c * D + sum(c * x.in_features for x in linears if x.in_features != D or x is attn.o_proj)
             + c * (H + K) * d_qk + v + core + sum(c * w for _, w in norms)
             + 4 * (2 + sum(rows.get(n, 1) for n, _ in norms)))
        if not cfg.train.compile:  # eager: each norm keeps its float32 copy and its cast-back, not its input
            a += 4 * 2 * D + sum((4 + c) * widths[n] - c * w for n, w in norms)
    mlp = layer.mlp
    if not isinstance(getattr(mlp, "experts", None), GroupedExperts):
        return a, c * D + swiglu_mlp(mlp, c, mode, cfg.train.compile)
    ex, A = mlp.experts, m.top_k
    routing = c * mlp.balance.num_experts + 8 * A + 4 * A + 4  # logits (router's width), ids, weights, their sum
    rows = {"none": 2 * D + 3 * ex.hidden, "cheap": 2 * D + 2 * ex.hidden, "selective": 2 * D}[mode]
    if cfg.parallel.ep and cfg.parallel.ep > 1:  # the busiest rank's rows; the combine's received rows
        rows = rows * busiest(m.family, cfg.parallel.ep) + (D if mode != "selective" else 0)
    combine = c * A + 2 * 8 * A + (8 * A if ex.b13_EF2 is not None else 0)  # unpermute's weights and
    shared = getattr(mlp, "shared_experts", None)  # indices; the rows' expert ids for the biases
    if shared is not None:  # its input: its own copy, compiled or eager
        shared = c * D + swiglu_mlp(shared, c, mode, cfg.train.compile)
    return a, c * D + routing + round(c * A * rows) + combine + (shared or 0)


@functools.lru_cache(maxsize=None)
def busiest(family: str, ep: int) -> float:
    """The busiest expert-parallel rank's rows over the mean under the calibration's routing (the
    cost file's balance at this ep; 1 for a family it has not measured)."""
    fam = perf.load_costs()["families"].get(family)
    return perf.measured_at(fam["balance"]["group_max_mean"], ep) if fam else 1.0


def swiglu_mlp(mlp: nn.Module, c: int, mode: str, compiled: bool) -> int:
    """Bytes per token a dense SwiGLU MLP keeps beyond its input: gate, up and their product (none;
    eager also silu(gate)); gate and up, the GEMMs' outputs its backward reads (cheap); nothing
    (selective)."""
    F = mlp.gate_proj.out_features
    return {"none": (3 + (not compiled)) * c * F, "cheap": 2 * c * F, "selective": 0}[mode]


def in_flight(cfg: Config, dims: ParallelDims, chunk_bytes: list[int]) -> int:
    """The most activation bytes held at once over the step: one micro-batch without a pipeline;
    with one, replay this rank's op list (F holds a chunk's activations, W or BW releases them)."""
    if not dims.pp_enabled:
        return chunk_bytes[0]
    ops = perf.op_lists(cfg.parallel.pp_schedule, dims.pp, cfg.train.grad_accum)[dims.pp_rank]
    held, most = [0] * len(chunk_bytes), 0
    for op in ops:
        if op.kind in ("F", "FB"):
            held[op.chunk] += 1
        if op.kind in ("W", "BW"):
            held[op.chunk] -= 1
        most = max(most, sum(h * b for h, b in zip(held, chunk_bytes)))
        if op.kind == "FB":
            held[op.b_chunk] -= 1
    return most


# ---------------------------------------------------------------------------------------------
# One rank's plan


def rank_plan(cfg: Config, dims: ParallelDims, model: nn.Module, chunks, precision: Precision) -> dict:
    t, m = cfg.train, cfg.model
    c = precision.compute.itemsize
    pbytes = c  # the compute weights' dtype (FSDP's gathers, the bf16 copies: precision.py)
    rbytes = precision.reduce.itemsize
    state = precision.bytes_per_param()
    n = sum(local(p).numel() for p in model.parameters())  # tied parameters once
    T = t.micro_batch_size * t.seq_len // dims.cp
    D, V = m.hidden_size, m.vocab_size

    layers = dict(indexed_layers(model))
    # bytes kept between forward and backward under train.activation_checkpoint, and bytes of the
    # layer's whole activations: what its backward (or recompute) holds at once
    saved = {i: T * sum(layer_activations(x, i, cfg, c, t.activation_checkpoint)) for i, x in layers.items()}
    whole = {i: T * sum(layer_activations(x, i, cfg, c, "none")) for i, x in layers.items()}
    expert_ps = [p for x in layers.values() for b in moe_blocks(x) for p in b.experts.parameters()]
    head = getattr(model, "lm_head", None) is not None
    ends = T * 4 * c * D if head else 0  # final norm; the loss's bf16 h and dh
    rope = T * 4 * (getattr(m, "qk_rope_head_dim", None) or m.head_dim)  # float32 cos and sin, every layer's
    chunks = chunks or [pipeline.Chunk(0, sorted(layers), True, True)]
    chunk_bytes = [sum(saved[i] for i in ch.layer_ids) + rope + (ends if ch.last else 0) for ch in chunks]
    acts = in_flight(cfg, dims, chunk_bytes)

    # Unsharded sizes FSDP gathers: every dense parameter whole, experts as the ep split leaves
    # them (E / ep), none when FSDP leaves them out (dims.experts_alone).
    def unsharded(mod, experts: bool):
        ex = {id(p) for b in moe_blocks(mod) for p in b.experts.parameters()}
        return sum(p.numel() // dims.ep if id(p) in ex else p.numel() for p in mod.parameters()
                   if (id(p) in ex) == experts and not (experts and dims.experts_alone))
    dense = [unsharded(x, False) for x in layers.values()] or [0]
    expert = [unsharded(x, True) for x in layers.values()] or [0]
    layer_full = max(d + e for d, e in zip(dense, expert))
    root_full = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("layers."))
    comm = keep = 0  # keep: the bytes precision.keep adds (every layer's dense part gathered for the step)
    if dims.fsdp_enabled:  # the root, the current and the prefetched layer, one layer's gradients
        comm += root_full * pbytes + 2 * layer_full * pbytes + layer_full * (pbytes + rbytes)
        if precision.keep:  # and the root's all-gather buffer, which FSDP frees at the next gather
            keep = (max(sum(dense) - 2 * max(dense), 0) + root_full) * pbytes
    if dims.ep_enabled:
        comm += 2 * c * m.top_k * T * D
    # train.fp8: each expert weight's unsharded FP8 copies (q and q^T, 1 B each) live for the step.
    cache = sum(2 * p.numel() // dims.ep for p in expert_ps) if t.fp8 else 0
    head_grad = m.vocab_size * D * pbytes if head else 0  # linear_ce's dW, made in the forward
    grads = state["grads"] * n
    held = grads + head_grad if t.grad_accum > 1 else head_grad
    logits = c * min(LOSS_CHUNK, T) * V if head else 0
    # the precision's bf16 copies (kept across steps): every weight, or the experts FSDP leaves out
    copy = state["copy"] * {"all": n, "experts": sum(local(p).numel() for p in expert_ps), "none": 0}[precision.copy]
    static = state["weights"] * n + state["optimizer"] * n + copy + cache + WORKSPACE
    largest = max(whole.values(), default=0)
    fwd = static + acts + held + logits + comm + keep
    bwd = static + grads + max(acts - max(chunk_bytes), 0) + largest + comm + keep
    fsdp_traffic = {k: fsdp_bytes(model, dims, t.grad_accum, pb, rb)
                    for k, (pb, rb) in (("float32", (4, 4)), ("policy", (pbytes, rbytes)))}
    return {"rank": dims.rank, "stage": dims.pp_rank, "params": state["weights"] * n, "grads": grads,
            "optimizer": state["optimizer"] * n, "activations": acts, "comm": comm + keep,
            "keep": dims.fsdp_enabled and precision.keep, "keep_bytes": keep, "fp8_cache": cache,
            "bf16_copy": copy, "workspace": WORKSPACE, "peak": max(fwd, bwd),
            "fsdp_bytes_per_step": fsdp_traffic}


def fsdp_bytes(model: nn.Module, dims: ParallelDims, micro_batches: int, pbytes: int, rbytes: int) -> int:
    """Bytes one rank sends per optimizer step in FSDP collectives (ring: (n-1)/n of each
    collective's unsharded buffer): per micro-batch each layer is gathered twice (forward,
    backward) and the root once, and every gradient is reduce-scattered once; HSDP adds an
    all-reduce of the shards over the replicas. Experts over efsdp ranks and replicated over edp
    (nothing when FSDP leaves them out: efsdp = edp = 1), the rest over fsdp * cp and dp."""
    if not dims.fsdp_enabled:
        return 0
    experts = {id(p) for b in moe_blocks(model) for p in b.experts.parameters()}
    total = 0.0
    for name, p in {id(p): (n, p) for n, p in model.named_parameters()}.values():
        is_expert = id(p) in experts
        k, reps = (dims.efsdp, dims.edp) if is_expert else (dims.fsdp * dims.cp, dims.dp)
        full = p.numel() // (dims.ep if is_expert else 1)
        gathers = 2 if name.startswith("layers.") else 1
        total += micro_batches * full * (k - 1) / k * (gathers * pbytes + rbytes)
        total += micro_batches * 2 * (reps - 1) / reps * full / k * rbytes
    return int(total)


# ---------------------------------------------------------------------------------------------
# The whole plan, and the automatic layout


def plan(cfg: Config, world_size: int, gpu_gib: float, gpu: str = "", models: dict | None = None) -> dict:
    """The plan of cfg's layout on `world_size` GPUs of `gpu_gib` GiB (ConfigError if the layout
    is invalid): one entry per pipeline stage, the peak of the largest; where it does not fit, the
    one-line "refusal" build.check_run raises. `models`: a cache of the rank models by layout (the
    search plans one layout under several policies and batches; its model does not depend on them)."""
    ranks, models = [], {} if models is None else models
    pp = ParallelDims.from_config(cfg, world_size, 0).pp
    for stage in range(pp):
        dims = ParallelDims.from_config(cfg, world_size, stage * world_size // pp)
        key = (tuple(layout_of(vars(cfg.parallel)).values()), stage)
        if key not in models:  # this rank's piece on meta, built as train.py builds it, and its precision on a GPU
            with fake_world(world_size, dims.rank):
                if dims.distributed:
                    dims.build_meshes("cpu")
                run = build_run(cfg, torch.device("meta"), dims)
            models[key] = run.model, run.chunks, Precision.of(cfg.train, torch.device("cuda"), dims)
        ranks.append(rank_plan(cfg, dims, *models[key]))
    if max(x["peak"] for x in ranks) > FIT_FRACTION * gpu_gib * GIB:  # no room to keep the layers gathered
        for x in ranks:
            x.update(peak=x["peak"] - x["keep_bytes"], comm=x["comm"] - x["keep_bytes"], keep=False, keep_bytes=0)
    peak = max(x["peak"] for x in ranks) / GIB
    result = {"gpu": gpu, "gpu_gib": gpu_gib, "usable_gib": FIT_FRACTION * gpu_gib, "world_size": world_size,
              "keep": all(x["keep"] for x in ranks), "layout": {k: getattr(cfg.parallel, k) for k in LAYOUT_KEYS},
              **{k: getattr(cfg.train, k) for k in TRAIN_CHOICES}, "global_batch_tokens": global_batch(cfg),
              "ranks": ranks, "peak_gib": peak, "fits": peak <= FIT_FRACTION * gpu_gib}
    if not result["fits"]:
        result["refusal"] = refusal(cfg, result, world_size)
    return result


# What `parallel: auto` chooses besides the layout: the recomputation (train.activation_checkpoint:
# auto) and, for a recipe that fixes train.global_batch_tokens, the micro-batch and accumulation.
TRAIN_CHOICES = ("activation_checkpoint", "micro_batch_size", "grad_accum")
POLICIES = ("none", "cheap", "selective", "full")  # least recomputation first
TIE = 0.005  # predictions this close rank by micro-batch size (ranked)


def global_batch(cfg: Config) -> int:
    """Tokens per optimizer step: train.global_batch_tokens, else micro-batch x accumulation x
    sequence x cfg's data-parallel ranks (dp x fsdp)."""
    t, p = cfg.train, cfg.parallel
    return (t.global_batch_tokens if t.global_batch_tokens is not None
            else t.micro_batch_size * t.grad_accum * t.seq_len * ((p.dp or 1) * (p.fsdp or 1)))


def check_global_batch(cfg: Config, world_size: int) -> None:
    """A recipe that fixes train.global_batch_tokens in a layout it gives: micro_batch_size x
    grad_accum x data-parallel ranks x seq_len must be it (ConfigError, one line, otherwise)."""
    t, n = cfg.train, cfg.train.global_batch_tokens
    if n is None or cfg.parallel.auto:
        return
    dp = ParallelDims.from_config(cfg, world_size, 0).data_parallel_size
    got = t.micro_batch_size * t.grad_accum * dp * t.seq_len
    if got != n:
        rows = n // t.seq_len
        fix = (f"set train.grad_accum={rows // (dp * t.micro_batch_size)}" if rows % (dp * t.micro_batch_size) == 0
               else "change train.micro_batch_size")
        raise ConfigError(f"{cfg.source}: train.global_batch_tokens: {n} is not micro_batch_size x grad_accum x "
                          f"data-parallel ranks x seq_len = {t.micro_batch_size} x {t.grad_accum} x {dp} x "
                          f"{t.seq_len} = {got}; {fix}, or use parallel: auto, which chooses them")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def batches(cfg: Config, lay: dict) -> list[tuple[int, int]]:
    """(micro_batch_size, grad_accum) options in layout `lay`: under parallel: auto with
    train.global_batch_tokens every micro-batch size dividing a data-parallel rank's sequences
    (none when they do not divide over its ranks); else the recipe's."""
    t = cfg.train
    if t.global_batch_tokens is None or not cfg.parallel.auto:
        return [(t.micro_batch_size, t.grad_accum)]
    rows, dp = t.global_batch_tokens // t.seq_len, lay["dp"] * lay["fsdp"]
    return [] if rows % dp else [(mb, rows // dp // mb) for mb in divisors(rows // dp)]


def candidates(cfg: Config, world_size: int) -> list[dict]:
    """Every (layout, activation_checkpoint, micro_batch_size, grad_accum) `parallel: auto` may
    choose. Layouts: pp a divisor of the world the step's micro-batches can fill (pp <= grad_accum
    and the layers; 1 under document masking or evaluation, which a pipeline does not run), cp as
    given (else 1), every dp x fsdp split of the rest and every ep dividing the experts; for a
    pipeline both schedules and DualPipeV's overlap where ep > 1 and nothing is recomputed. Sizes
    (and pp_schedule, pp_overlap) the recipe gives are kept. Recomputation: every policy under
    train.activation_checkpoint: auto, else the recipe's; micro-batch and accumulation: `batches`.
    parallel_dims.validate then rejects what cannot run (DualPipeV with fewer than 2 pp
    micro-batches, ...)."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    given = {k: getattr(p, k) for k in LAYOUT_KEYS if getattr(p, k) is not None}
    policies = POLICIES if t.activation_checkpoint == "auto" else (t.activation_checkpoint,)
    most = t.grad_accum if t.global_batch_tokens is None else t.global_batch_tokens // t.seq_len
    pps = ([given["pp"]] if "pp" in given else [1] if cfg.data.document_mask or t.eval_every
           else [d for d in divisors(world_size) if d <= min(m.num_layers, most)])
    out = []
    for pp in pps:
        cp = given.get("cp", 1)
        if world_size % (pp * cp):
            continue
        rest = world_size // (pp * cp)
        for dp in [given["dp"]] if "dp" in given else divisors(rest):
            fsdp = given.get("fsdp", rest // dp)
            if dp * fsdp != rest:
                continue
            experts = getattr(m, "num_experts", None)
            for ep in [given["ep"]] if "ep" in given else (
                    [e for e in divisors(dp * fsdp * cp) if experts % e == 0] if experts else [1]):
                schedules = [(s, o) for s in ([p.pp_schedule] if p.pp_schedule else ["1f1b", "dualpipev"])
                             for o in ([p.pp_overlap] if p.pp_overlap is not None else [False, True])
                             if not o or (s == "dualpipev" and ep > 1)]
                if pp == 1:  # no pipeline: the schedule fields say nothing
                    schedules = [(p.pp_schedule or "1f1b", bool(p.pp_overlap))]
                lay = {"pp": pp, "dp": dp, "fsdp": fsdp, "cp": cp, "ep": ep}
                for (mb, accum), (s, o), ac in itertools.product(batches(cfg, lay), schedules, policies):
                    if pp <= accum and (not o or ac == "none"):
                        out.append({**lay, "pp_schedule": s, "pp_overlap": o, "activation_checkpoint": ac,
                                    "micro_batch_size": mb, "grad_accum": accum})
    return out


def with_choice(cfg: Config, c: dict) -> Config:
    """cfg with candidate `c`'s layout (sizes, pp_schedule, pp_overlap) and, where it has them, its
    recomputation, micro-batch and accumulation: a new Config sharing cfg's other sections; cfg
    itself is not changed."""
    train = {k: c[k] for k in TRAIN_CHOICES if k in c}
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **layout_of(c)),
                               train=dataclasses.replace(cfg.train, **train) if train else cfg.train)


def ranked(cfg: Config, world_size: int, gpu: str, costs: dict | None = None) -> list[dict]:
    """The valid candidates, each with its perf.predict (`costs`: the cost file's), fastest
    (tokens/s per GPU) first; predictions within TIE of each other are a tie, which the larger
    micro-batch takes (fewer, larger GEMMs: the model, linear in a micro-batch's tokens, does not
    see that a GPU runs small ones less well). A family the cost file has not measured: prediction None, and by
    memory alone: the fewest parameters per rank first (perf.local_params), then the least
    recomputation, then the largest micro-batch."""
    costs = costs or perf.load_costs()
    measured = cfg.model.family in costs["families"]
    out, memo = [], {}
    for c in candidates(cfg, world_size):
        chosen = with_choice(cfg, c)
        try:
            ParallelDims.from_config(chosen, world_size, 0)
        except ConfigError:
            continue
        out.append({**c, "prediction": perf.predict(chosen, c, gpu, costs, memo=memo) if measured else None})
    if not measured:
        return sorted(out, key=lambda c: (perf.local_params(cfg, c), POLICIES.index(c["activation_checkpoint"]),
                                          -c["micro_batch_size"]))
    return sorted(out, key=lambda c: (-math.floor(math.log(c["prediction"]["tokens_per_s_per_gpu"]) / math.log1p(TIE)),
                                      -c["micro_batch_size"]))


def auto_layout(cfg: Config, world_size: int, gpu_gib: float | None, gpu: str = "",
                max_plans: int | None = None) -> tuple[dict, dict | None]:
    """`parallel: auto`'s choice for cfg's unset sizes (and recomputation, micro-batch and
    accumulation where the recipe leaves them to it: candidates): the fastest valid candidate
    (perf.predict on `gpu`, or on the cost file's GPU; ranked) whose memory plan fits `gpu_gib`
    GiB, planning in order of speed until one fits (else the smallest peak). Returns (the choice:
    layout_of's keys and TRAIN_CHOICES, that plan with its "prediction", "choice" and the ranking
    as "candidates": the planned ones carry peak_gib and fits); without gpu_gib nothing is planned:
    (the fastest valid candidate, None). `max_plans`: plan at most that many. cfg is not changed
    (with_choice makes the resolved Config)."""
    options = ranked(cfg, world_size, gpu_key(gpu) or perf.load_costs()["gpu"])
    if not options:
        raise ConfigError(f"{cfg.source}: parallel: auto found no valid layout for {world_size} processes "
                          f"(tried {len(candidates(cfg, world_size))} candidates); give the sizes explicitly"
                          + (" or another train.global_batch_tokens" if cfg.train.global_batch_tokens else ""))
    if gpu_gib is None:
        return choice_of(options[0]), None
    best, models = None, {}
    layers = decoder_layers(build_model(cfg.model, init=False))  # meta, unsharded
    per_token = {mode: {i: sum(layer_activations(x, i, cfg, 2, mode)) for i, x in enumerate(layers)}
                 for mode in POLICIES}
    for c in options[:max_plans]:
        chosen = with_choice(cfg, c)
        if (floor := floor_gib(chosen, world_size, per_token)) > FIT_FRACTION * gpu_gib:
            c["peak_floor_gib"], c["fits"] = floor, False
            continue
        result = plan(chosen, world_size, gpu_gib, gpu, models=models)
        c["peak_gib"], c["fits"] = result["peak_gib"], result["fits"]
        if best is None or result["fits"] or result["peak_gib"] < best[1]["peak_gib"]:
            best = (c, result)
        if result["fits"]:
            break
    if best is None:  # every bound was over: plan the smallest, for its refusal
        c = min(options[:max_plans], key=lambda c: c["peak_floor_gib"])
        best = (c, plan(with_choice(cfg, c), world_size, gpu_gib, gpu, models=models))
        c["peak_gib"] = best[1]["peak_gib"]
    return choice_of(best[0]), {**best[1], "prediction": best[0]["prediction"], "choice": choice_of(best[0]),
                                "candidates": options}


def floor_gib(cfg: Config, world_size: int, per_token: dict) -> float:
    """A lower bound of cfg's planned peak that needs no rank model: each pipeline rank's training
    state (perf.local_params of its layers at Precision.bytes_per_param) and its in-flight
    activations (`per_token`: {policy: {layer: bytes per token}}, layer_activations of the unsharded
    model, which the sharding does not change), the largest over the ranks of one data-parallel
    group. auto_layout plans no candidate whose bound is over the GPU."""
    p, t = cfg.parallel, cfg.train
    most = 0
    for stage in range(p.pp):
        dims = ParallelDims.from_config(cfg, world_size, stage * world_size // p.pp)
        state = Precision.of(t, torch.device("cuda"), dims).bytes_per_param()
        chunks = (schedule.rank_chunks(stage, p.pp, p.pp_schedule, cfg.model.num_layers, p.pp_layers)
                  if p.pp > 1 else [pipeline.Chunk(0, list(range(cfg.model.num_layers)), True, True)])
        T = t.micro_batch_size * t.seq_len // dims.cp
        saved = [T * sum(per_token[t.activation_checkpoint][i] for i in ch.layer_ids) for ch in chunks]
        n = perf.local_params(cfg, layout_of(vars(p)), chunks)
        most = max(most, n * (state["weights"] + state["grads"] + state["optimizer"]) + in_flight(cfg, dims, saved))
    return most / GIB


def layout_of(c: dict) -> dict:
    return {k: c[k] for k in (*LAYOUT_KEYS, "pp_schedule", "pp_overlap")}


def choice_of(c: dict) -> dict:
    return {**layout_of(c), **{k: c[k] for k in TRAIN_CHOICES}}


def describe(result: dict) -> str:
    lay = " ".join(f"{k}={v}" for k, v in result["layout"].items())
    return (f"{lay} on {result['world_size']} x {result['gpu'] or 'GPU'}: peak {result['peak_gib']:.1f} GiB "
            f"of {result['usable_gib']:.1f} usable ({FIT_FRACTION:.0%} of {result['gpu_gib']:.1f})")


def refusal(cfg: Config, result: dict, world_size: int) -> str:
    """One line: by how much the plan is over, and what to change."""
    over = result["peak_gib"] - result["usable_gib"]
    t, hints = cfg.train, []
    if t.activation_checkpoint != "full":
        hints.append("train.activation_checkpoint=full")
    if t.micro_batch_size > 1:
        hints.append(f"a smaller train.micro_batch_size (now {t.micro_batch_size})")
    if not cfg.parallel.auto:
        hints.append("parallel: auto (it adds pipeline stages when needed)")
    hints.append(f"more GPUs than {world_size} (invoke train --nproc N: one process per GPU)")
    return (f"{cfg.source}: parallel: the memory plan does not fit: {describe(result)}, over by "
            f"{over:.1f} GiB (`invoke plan` shows each part); try {', or '.join(hints)}")


# ---------------------------------------------------------------------------------------------
# The layout of a run


def resolve(cfg: Config, world_size: int, gpu: str = "", gpu_gib: float | None = None) -> tuple[Config, dict | None]:
    """cfg on `world_size` GPUs: (cfg with what `parallel: auto` and `activation_checkpoint: auto`
    leave open chosen (auto_layout; a new Config, cfg unchanged) or cfg itself, the plan of that
    choice against `gpu_gib` GiB, or None without it). A layout that does not fit is
    build.check_run's to refuse; a given layout whose batch is not train.global_batch_tokens,
    ConfigError here."""
    check_global_batch(cfg, world_size)  # a layout the recipe gives (parallel: auto chooses the batch)
    if cfg.parallel.auto or cfg.train.activation_checkpoint == "auto":
        choice, result = auto_layout(cfg, world_size, gpu_gib, gpu)
        return with_choice(cfg, choice), result
    return cfg, None if gpu_gib is None else plan(cfg, world_size, gpu_gib, gpu)


def resolve_launch(cfg: Config, device: torch.device, world_size: int) -> tuple[Config, dict | None]:
    """train.py, before any process group or model exists: resolve on this device's GPU (its
    memory and name; on CPU nothing is planned)."""
    gpu_gib = torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else None
    if gpu_gib is not None and dist.is_initialized():
        print("pithtrain: memory plan skipped: this process already has a process group (the plan "
              "needs its own fake one)", flush=True)
        gpu_gib = None
    return resolve(cfg, world_size, torch.cuda.get_device_name(device) if gpu_gib else "", gpu_gib)


def launch_line(cfg: Config, result: dict | None) -> str | None:
    """The line rank 0 prints for a resolved layout (`parallel: auto`, or any layout on CUDA):
    the sizes, what auto chose besides (recomputation, micro-batch and accumulation), the memory
    plan, the prediction; for a family the cost file has not measured, that auto chose by memory
    alone."""
    if result is None and not cfg.parallel.auto:
        return None
    lay = " ".join(f"{k}={getattr(cfg.parallel, k)}" for k in LAYOUT_KEYS)
    if result and "choice" in result or cfg.train.global_batch_tokens:
        lay += ", " + " ".join(f"{k}={getattr(cfg.train, k)}" for k in TRAIN_CHOICES)
    family, said = cfg.model.family, ""
    measured = family in perf.load_costs()["families"]
    if result and measured and (key := gpu_key(result["gpu"])):
        pred = result.get("prediction") or perf.predict(cfg, layout_of(vars(cfg.parallel)), key)
        said = f"; predicted {pred['tokens_per_s_per_gpu'] / 1e3:.1f}K tokens/s per GPU (pithtrain/perf.py)"
        if "candidates" in result:
            said += f", the fastest of {len(result['candidates'])} valid candidates whose plan fits"
    if cfg.parallel.auto and not measured:
        said += (f"; chosen by memory alone (fewest parameters per rank): the cost file has no {family!r}, "
                 "`python scripts/calibrate.py --models RECIPE` measures it")
    return (f"pithtrain: parallel {'auto' if cfg.parallel.auto else 'layout'}: {lay} " + (
            f"(memory plan: peak {result['peak_gib']:.1f} GiB of {result['usable_gib']:.1f} usable{said})"
            if result else f"(no GPU memory to plan against{said})"))


# ---------------------------------------------------------------------------------------------
# Entry point


def table(result: dict) -> str:
    cols = ("params", "grads", "optimizer", "activations", "comm", "fp8_cache", "bf16_copy", "workspace", "peak")
    lines = [f"plan: {describe(result)}, activation checkpointing {result['activation_checkpoint']}, "
             f"micro-batch {result['micro_batch_size']} x {result['grad_accum']} accumulated "
             f"({result['global_batch_tokens']:,} tokens per step)",
             f"{'rank':>5} {'stage':>5} " + " ".join(f"{c:>11}" for c in cols) + "   (GiB)"]
    for x in result["ranks"]:
        lines.append(f"{x['rank']:>5} {x['stage']:>5} " + " ".join(f"{x[c] / GIB:>11.2f}" for c in cols))
    traffic = result["ranks"][0]["fsdp_bytes_per_step"]
    if traffic["float32"]:
        lines.append(f"FSDP traffic per step, rank 0: {traffic['float32'] / GIB:.2f} GiB with float32 "
                     f"gathers and reductions, {traffic['policy'] / GIB:.2f} GiB with the mixed-precision policy")
    if result.get("prediction"):
        pr = result["prediction"]
        lines.append(f"predicted on {pr['gpu']}: {pr['tokens_per_s_per_gpu'] / 1e3:.1f}K tokens/s per GPU, step "
                     f"{pr['step_s']:.2f} s (" + ", ".join(f"{k} {v:.2f}" for k, v in pr["parts_s"].items()) + " s)")
    if result.get("candidates"):
        lines += why(result)
    lines.append(f"fits: {'yes' if result['fits'] else 'no'}")
    return "\n".join(lines)


def why(result: dict, before: int = 6, after: int = 4) -> list[str]:
    """The choice among the ranked candidates: the `before` faster ones next to it (planned: each
    does not fit, by how much), the chosen one, and the `after` next slower ones (by how much)."""
    options, choice = result["candidates"], result["choice"]
    at = next(i for i, c in enumerate(options) if choice_of(c) == choice)
    speed = [c["prediction"] and c["prediction"]["tokens_per_s_per_gpu"] for c in options]
    usable = result["usable_gib"]

    def row(i, c):
        lay = " ".join(f"{k}={c[k]}" for k in LAYOUT_KEYS if c[k] > 1) or "one process"
        lay += f" {c['pp_schedule']}{' overlap' if c['pp_overlap'] else ''}" if c["pp"] > 1 else ""
        pred = f"{speed[i] / 1e3:6.1f}K" if speed[i] else "     -"
        peak = f"{c['peak_gib']:6.1f}" if "peak_gib" in c else "     -"
        if i == at:
            reason = "chosen" if c.get("fits") else "chosen: the smallest peak, nothing fits"
        elif "peak_gib" in c and not c["fits"]:
            reason = f"does not fit by {c['peak_gib'] - usable:.1f} GiB"
        elif "peak_floor_gib" in c:
            reason = f"does not fit by at least {c['peak_floor_gib'] - usable:.1f} GiB (state and activations)"
        elif not speed[at]:
            reason = "later by memory alone"
        else:
            reason = (f"slower by {1 - speed[i] / speed[at]:.1%}" if i > at and speed[i] < speed[at] * (1 - TIE)
                      else f"a tie (within {TIE:.1%}): the larger micro-batch goes first")
        return (f"{'>' if i == at else ' '} {lay:<30} {c['activation_checkpoint']:<9} "
                f"{c['micro_batch_size']:>3} x {c['grad_accum']:<4} {pred} {peak}   {reason}")
    head = (f"choice: the {'fastest' if speed[at] else 'first by memory alone'} of {len(options)} valid candidates "
            "(layout x recomputation x micro-batch)" + (f" whose plan fits; {at} faster planned, none fits:" if at
                                                        else ", and its plan fits:"))
    lines = [head, f"  {'layout':<30} {'recompute':<9} {'mb x accum':<10} {'tok/s/GPU':>7} {'peak GiB':>6}"]
    return lines + [row(i, options[i]) for i in range(max(0, at - before), min(len(options), at + after + 1))]


def nearest_fit(recipe, overrides: list[str], gpu: str, world: int) -> str:
    """What would fit when `recipe` on `world` x `gpu` does not: the first of parallel: auto with
    the recomputation chosen too, half the micro-batch (a recipe without train.global_batch_tokens),
    then twice, four, eight times the GPUs (each planning auto's candidates in order of speed)."""
    cfg = load_config(recipe, overrides)
    auto = ["parallel.auto=true"] + (["train.activation_checkpoint=auto"] if cfg.train.activation_checkpoint != "auto"
                                     else [])
    tries = [(auto, world)]
    if cfg.train.micro_batch_size > 1 and cfg.train.global_batch_tokens is None:
        tries.append(([*auto, f"train.micro_batch_size={cfg.train.micro_batch_size // 2}"], world))
    tries += [(auto, world * k) for k in (2, 4, 8)]
    for extra, n in tries:
        try:
            c = load_config(recipe, [*overrides, *extra])
            r = auto_layout(c, n, GPUS[gpu].memory_gib, gpu)[1]
        except ConfigError:
            continue
        if r["fits"]:
            lay = " ".join(f"{k}={v}" for k, v in r["layout"].items() if v > 1) or "one process"
            return (f"{' '.join('--set ' + e for e in extra)} on {n} GPUs fits ({lay}, {r['activation_checkpoint']} "
                    f"recomputation: peak {r['peak_gib']:.1f} GiB)")
    return "nothing tried fits (auto with every recomputation, half the micro-batch, up to 8x the GPUs)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pithtrain.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="recipe file or embedded recipe name (default: the tiny default)")
    p.add_argument("--gpu", required=True, choices=sorted(GPUS))
    p.add_argument("--gpus", type=int, default=1, help="GPUs per node")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--set", action="append", default=[], help="section.key=value (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    world = args.gpus * args.nodes
    try:
        # What `invoke train --gpu` runs: the recipe, the GPU's overrides, then the user's.
        cfg, result = resolve(load_config(args.model, [*GPUS[args.gpu].overrides, *args.set]), world, args.gpu,
                              GPUS[args.gpu].memory_gib)
        if "prediction" not in result and cfg.model.family in perf.load_costs()["families"]:
            result["prediction"] = perf.predict(cfg, layout_of(vars(cfg.parallel)), args.gpu)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else table(result))
    if not result["fits"]:  # a plan that does not fit is a failed plan: say what would
        print(f"error: {result['refusal']}; nearest that fits: "
              f"{nearest_fit(args.model, [*GPUS[args.gpu].overrides, *args.set], args.gpu, world)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
