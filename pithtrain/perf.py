"""The performance model: a layout's step time and tokens/s per GPU, from costs one GPU measured.

    invoke plan --model qwen3-30b-a3b --gpu h100 --gpus 8      # the layouts that fit, fastest first
    python scripts/calibrate.py --models qwen3-30b-a3b           # measure its costs again (one H200 call)

Measured (the cost file, written by scripts/calibrate.py on the path `invoke train` runs: fused
kernels, compiled graphs, float32 masters), per family and path, at the recipe's tokens per
micro-batch:
    paths          "train": no FSDP (one GPU, pipeline stages alone): the bf16 copy of the weights
                   and in-place weight gradients; "fsdp": FSDP2 on a one-rank mesh with the
                   expert-parallel dispatcher (its casts, gathers and reduce-scatters as copies),
                   the experts left out of FSDP as when each rank's are its own (efsdp = edp = 1);
                   "fsdp_sharded": the same with the experts inside FSDP (layouts that shard or
                   replicate them); "bench": bf16 parameters, the bench's comparison
    layers[kind]   seconds of one decoder layer's forward and backward, for the first micro-batch
                   of a step and for later ones, and the forward's share by phase (kinds "dense",
                   "moe"; GPT-OSS "moe_window" and "moe_full"); layer_flops, head_flops: the
                   calibrated model's forward FLOPs per token (another width scales by them)
    embed, head    forward and backward seconds (head: final norm, LM head and loss)
    tail_per_param the step after the last backward (norm, clip, AdamW, balancing) per parameter
    experts        the experts phase alone with E/ep experts and tokens x top_k rows, ep = 1, 2, 4,
                   8: forward and backward seconds, bf16 and FP8 (experts_fp8)
    balance        the calibration's routing: max / mean load of an ep group's experts, and the
                   deduplicated rows a token sends to other ranks

Modelled on top of it (`predict`):
    compute        each layer at its tokens per micro-batch (T = micro-batch x seq / cp), linear in
                   T; the experts phase moved along the measured ep curve and slowed by the group
                   imbalance (the slowest rank sets the pace); activation checkpointing adds to
                   its backward what it recomputes, derived from the measured forward phases
                   (`recompute`: full the layer's forward, selective the experts phase, cheap the
                   attention phase's pointwise work and the SwiGLU activations). Another GPU
                   than the calibration's: the part of a phase its FLOPs at GEMM_EFFICIENCY of the
                   peak explain scales with the peak, the rest with memory bandwidth.
    collectives    the bytes the code sends, over the GPU's links (pithtrain/gpus.py) at LINK_EFFICIENCY plus ALPHA per
                   call: FSDP2's all-gathers (bf16, before forward and again before backward) and
                   reduce-scatters (train.reduce_dtype) of every layer and micro-batch, hidden
                   under the layer's compute (FSDP prefetches the next layer) but for what exceeds
                   it; HSDP's all-reduce over dp; the deduplicated all-to-all (a row of D + top_k
                   bf16 values and its ids, D values back; the same again in backward), exposed,
                   or under the other micro-batch's compute in DualPipeV's overlapped F&B pairs;
                   pipeline sends (T x D bf16 per hop); context parallel's K/V gathers
    pipeline       schedule.simulate over the op lists with these chunk costs (so the bubble), the
                   backward split into B and W by the weight-gradient share of its FLOPs
Left out: the pipeline executor's own per-phase autograd cost, two streams contending for SMs,
NCCL kernels' SMs, stragglers, data loading, checkpoint saves. docs/parallelism.md says where the
model was checked against a measurement and how far off it was.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from pithtrain.distributed.parallel_dims import ParallelDims
from pithtrain.distributed.schedule import build_schedule, num_virtual_stages, rank_stages, simulate, split_layers
from pithtrain.gpus import GPUS

COSTS = Path(__file__).resolve().parent / "costs_h200.json"  # scripts/calibrate.py writes it
# NCCL reaches ~370 of NVLink 4's 450 GB/s in all-gather, reduce-scatter and all-to-all (NCCL's
# maintainers in NVIDIA/nccl-tests#212) and 46-48 of an NDR HCA's 50 GB/s (NVIDIA/nccl-tests#290).
LINK_EFFICIENCY = {"nvlink": 0.82, "ib": 0.92}
ALPHA = {"nvlink": 15e-6, "ib": 30e-6}  # seconds per collective (NCCL's small-message latency)
GEMM_EFFICIENCY = 0.744  # the bf16 8192^3 GEMM on the H200: 736 of 989 TFLOP/s (docs/bench.md)


# op_lists(schedule, pp, micro_batches): schedule.build_schedule, kept: the planner asks for the same
# lists across its candidates, and building them for many micro-batches is most of its time. Read
# them, never change them.
op_lists = functools.lru_cache(maxsize=64)(build_schedule)


def load_costs(path: str | Path = COSTS) -> dict:
    return json.loads(Path(path).read_text())


# ---------------------------------------------------------------------------------------------
# The model's shape, layer by layer


def layer_kind(m, i: int) -> str:
    """The cost file's layer kind of layer i: "dense", "moe", or GPT-OSS's "moe_window" / "moe_full"."""
    if hasattr(m, "is_moe_layer") and not m.is_moe_layer(i):
        return "dense"
    if m.family == "gpt_oss":
        return "moe_window" if m.attention_shapes(i)[0] else "moe_full"
    return "moe"


def expert_params(m, i: int) -> int:
    """Routed-expert matmul parameters of layer i (0 for a dense layer): E x 3 x D x F."""
    return 0 if layer_kind(m, i) == "dense" else m.num_experts * 3 * m.hidden_size * getattr(m, m.expert_width_field)


def layer_flops(m, i: int, seq: int) -> tuple[float, float]:
    """(forward FLOPs per token of layer i, W / (B + W) of its backward): a linear's backward is
    two GEMMs of its forward's size, one the weight gradient; attention scores have no weights and
    cost about 2.5x their forward."""
    _, active = m.layer_params(i)
    window, d_qk, d_v, heads = m.attention_shapes(i)
    keys = min(window, seq) if window else seq / 2
    scores = 2 * keys * (d_qk + d_v) * heads
    return 2 * active + scores, 2 * active / (4 * active + 2.5 * scores)


def dims_of(lay: dict) -> ParallelDims:
    """The layout's sizes as ParallelDims, whose arithmetic (efsdp, edp, experts_alone) the model uses."""
    return ParallelDims(**{k: lay[k] for k in ("pp", "dp", "fsdp", "cp", "ep")})


def local_params(cfg, lay: dict, chunks: list | None = None) -> float:
    """Parameters one rank holds (its optimizer's share): dense ones over fsdp x cp, routed experts
    over ep x efsdp; a pipeline stage's share of the layers, or with `chunks` (schedule.Chunk: layer
    ids, first / last) exactly those layers, the embedding with the first, the head with the last."""
    m, d = cfg.model, dims_of(lay)
    ids = range(m.num_layers) if chunks is None else [i for ch in chunks for i in ch.layer_ids]
    dense = (2 if chunks is None else sum(ch.first + ch.last for ch in chunks)) * m.vocab_size * m.hidden_size
    experts = sum(expert_params(m, i) for i in ids)
    dense += sum(m.layer_params(i)[0] for i in ids) - experts
    return (dense / (d.fsdp * d.cp) + experts / (d.ep * d.efsdp)) / (d.pp if chunks is None else 1)


# ---------------------------------------------------------------------------------------------
# Collectives and another GPU


def link(gpu: str, span: int) -> tuple[float, float]:
    """(bytes/s, seconds per call) of a collective over `span` consecutive ranks: NVLink inside a
    node, the network once it spans nodes."""
    g = GPUS[gpu]
    kind = "nvlink" if span <= g.per_node else "ib"
    return (g.nvlink_gbs if kind == "nvlink" else g.network_gbs) * 1e9 * LINK_EFFICIENCY[kind], ALPHA[kind]


def ring_time(gpu: str, nbytes: float, ranks: int, span: int) -> float:
    """An all-gather or reduce-scatter of an `nbytes` unsharded buffer over `ranks` ranks spread
    over `span` consecutive ones: each rank sends (ranks - 1) / ranks of it."""
    if ranks <= 1:
        return 0.0
    bw, alpha = link(gpu, span)
    return alpha + nbytes * (ranks - 1) / ranks / bw


def remote_rows_per_token(E: int, k: int, ep: int) -> float:
    """Deduplicated rows a token sends to other ep ranks under uniform routing: each other rank
    receives one row when it holds at least one of the token's k experts (none when ep = 1)."""
    return (ep - 1) * (1 - math.comb(E - E // ep, k) / math.comb(E, k))


def on_gpu(secs: float, flops: float, measured_on: str, gpu: str) -> float:
    """Seconds on `gpu` of work measured on `measured_on`: the part its FLOPs at GEMM_EFFICIENCY of
    the peak explain scales with the peak, the rest with memory bandwidth."""
    peak0, bw0 = GPUS[measured_on].peak_tflops, GPUS[measured_on].hbm_tbs
    peak, bw = GPUS[gpu].peak_tflops, GPUS[gpu].hbm_tbs
    bound = min(secs, flops / (GEMM_EFFICIENCY * peak0 * 1e12))
    return bound * peak0 / peak + (secs - bound) * bw0 / bw


# ---------------------------------------------------------------------------------------------
# One rank's compute per micro-batch


def measured_at(table: dict, ep: int):
    """The entry measured at this ep, else at the largest measured ep below it (the experts' curve
    is flat by then: each rank's rows per expert grow, its experts' count shrinks)."""
    return table[str(max(int(k) for k in table if int(k) <= ep))]


def layer_costs(cfg, fam: dict, path: str, gpu: str, ep: int, T: float, which: str, fp8: bool) -> dict:
    """{layer: (F, BW)} seconds of one micro-batch of T tokens per rank ("first" or "later"
    micro-batch of the step)."""
    m, t = cfg.model, cfg.train
    out = {}
    for i in range(m.num_layers):
        kind = layer_kind(m, i)
        lay = fam["paths"][path]["layers"][kind]
        flops = layer_flops(m, i, t.seq_len)[0]
        scale = T / fam["tokens"] * flops / fam["layer_flops"][kind]  # another width: by its FLOPs
        F, BW = lay[which]["F"] * scale, lay[which]["BW"] * scale
        attn_F = lay["phases_F"]["attn"] * F
        mlp_F = F - attn_F  # a dense layer's MLP phase; a MoE layer's experts phase, below
        if kind != "dense":  # the experts phase at this layout's rows per expert (and in FP8)
            e1, ek = fam["experts"]["1"], measured_at(fam["experts"], ep)
            e8 = measured_at(fam["experts_fp8"], ep) if fp8 else ek
            imb = measured_at(fam["balance"]["group_max_mean"], ep)
            f1 = lay["phases_F"]["experts"] * F
            b1 = f1 * e1["BW"] / e1["F"]
            mlp_F = f1 * e8["F"] / e1["F"] * imb
            F += mlp_F - f1
            BW += b1 * (e8["BW"] / e1["BW"] * imb - 1)
        extra, extra_flops = recompute(cfg, i, t.activation_checkpoint, F, attn_F, mlp_F, fam["gpu"], T)
        out[i] = (on_gpu(F, T * flops, fam["gpu"], gpu),
                  on_gpu(BW + extra, 2 * T * flops + extra_flops, fam["gpu"], gpu))
    return out


def mlp_flops(m, i: int) -> float:
    """Forward FLOPs per token of layer i's MLP block: router, top-k routed and shared experts (a
    dense layer: its SwiGLU MLP); layer_flops less this is the attention phase's."""
    D = m.hidden_size
    if layer_kind(m, i) == "dense":
        return 2 * 3 * D * m.intermediate_size
    return 2 * (D * m.num_experts + m.top_k * expert_params(m, i) / m.num_experts + 3 * D * shared_width(m))


def shared_width(m) -> int:
    """The shared experts' hidden width (DeepSeek; 0 elsewhere)."""
    return getattr(m, "n_shared_experts", 0) and m.n_shared_experts * m.moe_intermediate_size


def recompute(cfg, i: int, mode: str, F: float, attn_F: float, mlp_F: float, measured_on: str,
              T: float) -> tuple[float, float]:
    """(seconds, FLOPs) activation checkpointing `mode` adds to layer i's backward, on the
    calibration GPU, derived from the measured forward of T tokens: F the layer's, attn_F its
    attention phase, mlp_F its experts phase as this layout runs it (a dense layer: its MLP phase):
        full       the layer's forward
        selective  the experts phase (a dense layer: its MLP phase)
        cheap      the attention phase less its GEMMs and attention kernel at GEMM_EFFICIENCY of
                   the peak (what is left is the pointwise work it recomputes: norms, RoPE, casts,
                   the residual), plus the SwiGLU activations at the GPU's memory bandwidth (one
                   pass: read gate and up, write their product, 3 x 2 B per element)"""
    m = cfg.model
    flops = layer_flops(m, i, cfg.train.seq_len)[0]
    if mode == "full":
        return F, T * flops
    dense = layer_kind(m, i) == "dense"
    if mode == "selective":
        return mlp_F, T * (mlp_flops(m, i) - (0 if dense else 2 * m.hidden_size * m.num_experts))
    if mode != "cheap":
        return 0.0, 0.0
    g = GPUS[measured_on]
    gemms = T * (flops - mlp_flops(m, i)) / (GEMM_EFFICIENCY * g.peak_tflops * 1e12)
    width = m.intermediate_size if dense else m.top_k * getattr(m, m.expert_width_field) + shared_width(m)
    return max(0.0, attn_F - gemms) + T * 3 * 2 * width / (g.hbm_tbs * 1e12), 0.0


def end_costs(cfg, fam: dict, path: str, gpu: str, T: float) -> dict:
    """{"embed" | "head": (F, BW)} seconds for one micro-batch of T tokens."""
    p, head = fam["paths"][path], 2 * cfg.model.vocab_size * cfg.model.hidden_size
    scale = {"embed": T / fam["tokens"], "head": T / fam["tokens"] * head / fam["head_flops"]}
    flops = {"embed": 0.0, "head": T * head}
    return {k: (on_gpu(p[k]["F"] * scale[k], flops[k], fam["gpu"], gpu),
                on_gpu(p[k]["BW"] * scale[k], 2 * flops[k], fam["gpu"], gpu)) for k in flops}


# ---------------------------------------------------------------------------------------------
# The step of a layout


def comm_costs(cfg, lay: dict, gpu: str, fam: dict, T: float) -> dict:
    """{layer: {"fsdp", "a2a", "cp"}} seconds of communication per layer and micro-batch."""
    m, t, d = cfg.model, cfg.train, dims_of(lay)
    pp, dp, cp, ep, efsdp = d.pp, d.dp, d.cp, d.ep, d.efsdp
    D, A, E = m.hidden_size, getattr(m, "top_k", 0), getattr(m, "num_experts", 1)
    shard, stage = d.fsdp * cp, dp * d.fsdp * cp
    rbytes = 4 if t.reduce_dtype == "float32" else 2
    rows = T * (fam["balance"]["remote_rows_per_token"].get(str(ep)) or remote_rows_per_token(E, A, ep)) if A else 0
    out = {}
    for i in range(m.num_layers):
        ex = expert_params(m, i)
        dense = m.layer_params(i)[0] - ex
        fs = 0.0
        if stage > 1:  # bf16 gathers before forward and backward, the reduce-scatter after it
            fs = (2 * (ring_time(gpu, dense * 2, shard, stage) + ring_time(gpu, ex / ep * 2, efsdp, shard))
                  + ring_time(gpu, dense * rbytes, shard, stage) + ring_time(gpu, ex / ep * rbytes, efsdp, shard))
        if dp > 1:  # HSDP: the shards' gradients all-reduced over the replicas
            fs += 2 * ring_time(gpu, dense / shard * rbytes, dp, pp * stage)
        a2a = 0.0
        if ep > 1 and ex:
            bw, alpha = link(gpu, ep)
            sent = rows * ((D + A) * 2 + A * 8) + rows * D * 2  # dispatch: rows, weights, ids; combine
            a2a = 2 * (sent / bw + 4 * alpha)  # forward, and the same bytes back in backward
        kv = 0.0
        if cp > 1:
            _, d_qk, d_v, heads = m.attention_shapes(i)
            kv = 2 * ring_time(gpu, T * cp * getattr(m, "num_kv_heads", heads) * (d_qk + d_v) * 2, cp, cp)
        out[i] = {"fsdp": fs, "a2a": a2a, "cp": kv}
    return out


def predict(cfg, lay: dict, gpu: str, costs: dict | None = None, path: str | None = None,
            memo: dict | None = None) -> dict:
    """Step seconds, tokens/s (all GPUs and per GPU) and the step's parts for cfg's model and
    train settings on layout `lay` ({pp, dp, fsdp, cp, ep}, optionally pp_schedule, pp_overlap;
    else cfg.parallel's) over GPUs of type `gpu`. `path`: the cost file's path to use (default:
    "fsdp" when the layout shards parameters, else "train"; "bench" for the bench's bf16 step).
    `memo`: a dict kept across calls for one model (the planner's ranking), holding the layers' costs
    by what they depend on."""
    costs = costs or load_costs()
    m, t = cfg.model, cfg.train
    if m.family not in costs["families"]:
        raise KeyError(f"the cost file has no {m.family!r} (has {sorted(costs['families'])})")
    fam = {**costs["families"][m.family], "gpu": costs["gpu"]}
    pp, dp, fsdp, cp = (lay[k] for k in ("pp", "dp", "fsdp", "cp"))
    schedule = lay.get("pp_schedule", cfg.parallel.pp_schedule)
    overlap = bool(lay.get("pp_overlap", cfg.parallel.pp_overlap)) and pp > 1 and lay["ep"] > 1
    world, M = pp * dp * fsdp * cp, t.grad_accum
    d = dims_of(lay)
    path = path or ("train" if not d.fsdp_enabled else "fsdp" if d.experts_alone else "fsdp_sharded")
    if path == "fsdp" and path not in fam["paths"]:  # measured before FSDP left such experts out: its
        path = "fsdp_sharded"  # costs are those of the experts inside FSDP (the prediction says which)
    T = t.micro_batch_size * t.seq_len / cp
    memo = {} if memo is None else memo
    key = (path, gpu, lay["ep"], T, t.fp8, t.activation_checkpoint)  # what the layers' costs depend on
    costs_mb = memo[key] = memo[key] if key in memo else {
        w: layer_costs(cfg, fam, path, gpu, lay["ep"], T, w, t.fp8) for w in ("first", "later")}
    ends = end_costs(cfg, fam, path, gpu, T)
    key = ("comm", gpu, T, t.reduce_dtype, *(lay[k] for k in ("pp", "dp", "fsdp", "cp", "ep")))
    comm = memo[key] = memo[key] if key in memo else comm_costs(cfg, lay, gpu, fam, T)
    tail = on_gpu(fam["paths"][path]["tail_per_param"] * local_params(cfg, lay), 0.0, fam["gpu"], gpu)

    def chunk(layers, first_end, last_end, which):
        """(compute F, compute BW, exposed FSDP + CP, all-to-all, W share of BW) of one micro-batch
        through `layers` (+ the embedding / head it holds)."""
        lc = costs_mb[which]
        f, b = ((sum(lc[i][k] for i in layers) + (ends["embed"][k] if first_end else 0)
                 + (ends["head"][k] if last_end else 0)) for k in (0, 1))
        exposed = sum(max(0.0, comm[i]["fsdp"] - lc[i][0] - lc[i][1]) + comm[i]["cp"] for i in layers)
        if layers and dp * fsdp * cp > 1:  # the first gather of a micro-batch has nothing to hide under
            exposed += min(comm[layers[0]]["fsdp"] / 3, lc[layers[0]][0])
        w = sum(lc[i][1] * layer_flops(m, i, t.seq_len)[1] for i in layers)
        return f, b, exposed, sum(comm[i]["a2a"] for i in layers), w

    tokens = t.micro_batch_size * t.seq_len * M * dp * fsdp
    if pp == 1:
        everything = list(range(m.num_layers))
        f1, b1, x1, a1, _ = chunk(everything, True, True, "first")
        f2, b2, x2, a2, _ = chunk(everything, True, True, "later")
        step = f1 + b1 + x1 + a1 + (M - 1) * (f2 + b2 + x2 + a2) + tail
        parts = {"compute": f1 + b1 + (M - 1) * (f2 + b2), "fsdp_cp_exposed": x1 + (M - 1) * x2,
                 "all_to_all": a1 + (M - 1) * a2, "optimizer": tail, "bubble": 0.0}
    else:  # each virtual stage's chunk: its layers (and the embedding / head it holds), sends both ways
        V = num_virtual_stages(pp, schedule)
        stages = split_layers(m.num_layers, V, cfg.parallel.pp_layers, v_shape=schedule == "dualpipev")
        hop = ring_time(gpu, T * m.hidden_size * 2 * 2, 2, 2)  # one send: (ranks - 1) / ranks = 1/2
        ch = [chunk(ids, v == 0, v == V - 1, "later") for v, ids in enumerate(stages)]
        F = [f + x / 3 + a / 2 + hop for f, b, x, a, w in ch]
        W = [w for f, b, x, a, w in ch]
        B = [b - w + x * 2 / 3 + a / 2 + hop for f, b, x, a, w in ch]

        def pair(vf, vb):  # an F&B pair: the all-to-all under the other micro-batch's compute
            (f1, _, x1, a1, _), (_, b2, x2, a2, _) = ch[vf], ch[vb]
            return max(f1 + b2, (a1 + a2) / 2) + (x1 + x2) / 2 + 2 * hop
        makespan, busy, _ = simulate(op_lists(schedule, pp, M), schedule, F, B, W, pair if overlap else None)
        step = makespan + tail
        r = max(range(pp), key=lambda r: busy[r])  # the busiest rank's step
        vs = rank_stages(r, pp, schedule)
        comp, exposed = M * sum(ch[v][0] + ch[v][1] for v in vs), M * sum(ch[v][2] + 2 * hop for v in vs)
        parts = {"compute": comp, "fsdp_cp_exposed": exposed, "all_to_all": max(0.0, busy[r] - comp - exposed),
                 "optimizer": tail, "bubble": makespan - busy[r]}
    return {"layout": {k: lay[k] for k in ("pp", "dp", "fsdp", "cp", "ep")}, "gpu": gpu, "path": path,
            "step_s": step, "tokens_per_s": tokens / step, "tokens_per_s_per_gpu": tokens / step / world,
            "parts_s": parts}
