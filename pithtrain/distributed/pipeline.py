"""Pipeline parallelism: stage partitioning, schedules as printable per-rank op lists, and the executor.

    python -m pithtrain.distributed.pipeline dualpipev 4 8     # print a schedule and its bubble

Three parts, read top to bottom:

1. Partitioning. The layer stack is cut into V virtual stages. 1F1B: V = pp, rank r holds stage r.
   DualPipeV: V = 2 pp in a V shape, rank r holds chunk 0 = stage r and chunk 1 = stage 2pp-1-r, so
   rank 0 holds the first stage (embedding) and the last (norm + head + loss) and the last rank
   holds the turn of the V (its chunk 0 feeds its chunk 1 locally). `parallel.pp_layers` gives the
   layers per virtual stage; the balanced default gives every stage L // V layers and hands the
   remainder to stages that hold neither the embedding nor the head (DualPipeV: balanced per
   rank, rank 0 last, then halved between the rank's two chunks).

2. Schedules: `schedule_1f1b` and `schedule_dualpipev` return, for every rank, a plain list of `Op`s:
   F (forward of one chunk on one micro-batch), B (backward for the input only; the weight gradient
   is deferred), W (the deferred weight gradient of an earlier B), BW (full backward: B then W at
   once), FB (forward of one micro-batch overlapped with the full backward of another, see
   overlap.py), and SEND_F / RECV_F / SEND_B / RECV_B (activations forward, input-gradients back).
   `format_schedule` prints them; `simulate` replays the compute ops with unit costs and reports
   each rank's idle time, which the tests compare with the formulas below.

   Bubble: the largest idle time of any rank between the start of the step and the end of the
   last rank's work. F, B, W are the costs of one stage's forward, input-backward and weight-backward on
   one micro-batch (a full backward is B + W), p = pp ranks, M micro-batches:

     1F1B       (p - 1) (F + B + W)                the PipeDream-flush bubble, on every rank
     DualPipeV  (p - 1) (F&B + (B + W) - 3W)       DeepSeek's DualPipe table, (PP/2 - 1)(F&B + B - 3W)
                                                   with its B the full backward and PP/2 = p ranks;
                                                   F, B, W per chunk (half a rank's layers), F&B one
                                                   overlapped forward+backward pair: F + B + W when
                                                   nothing overlaps, less the communication time
                                                   that overlap hides under the other's compute

   `simulate` reaches both exactly when a chunk's forward and input-backward cost the same and
   W <= B (the usual assumption: each costs one pass of the matmuls); tests/test_pipeline_schedule.py
   checks it. With F = B = W = 1 and nothing overlapped DualPipeV idles 2(p - 1) chunk-units against
   1F1B's 3(p - 1) stage-units = 6(p - 1) chunk-units: the weight-gradient delay fills warm-up and
   cool-down with W work, and the two arms of the V keep both ends busy. It needs M >= 2p
   micro-batches and holds two chunks of weights per rank.

   What overlap buys on several GPUs: the F&B pairs hide the expert-parallel all-to-all (dispatch
   and combine of one micro-batch run on the communication stream while the other micro-batch's
   attention / experts compute), so each pair costs about max(compute, communication) instead of
   their sum, and by the formula every unit saved in F&B also shrinks the bubble by p - 1 units.
   With EP across nodes the DeepSeek-V3 report puts communication near 1:1 with computation, so
   without overlap up to half of an MoE layer's time is all-to-all; with it, that half hides.
   On one GPU with no EP there is nothing to hide (the GPU test only shows that the two-stream
   step computes the same numbers); on CPU the same ops run in order on one thread.
   Under FSDP, layers run whole (FSDP's hooks wrap a layer's call) and B is a full backward, so
   intra-layer overlap and the weight-gradient delay are given up there for now (PipelineRunner).

3. The executor (`PipelineRunner`) runs one rank's list with torch.distributed point-to-point
   sends and receives. Every chunk runs as a list of phases (overlap.py): the forward records each
   phase's detached inputs and outputs, B walks the phases backwards with torch.autograd.grad
   w.r.t. the phase inputs only (retain_graph), W then calls torch.autograd.backward w.r.t. the
   phase's parameters with the output gradients B saved. That is the split of backward into
   input- and weight-gradient the schedules assume; it re-traverses each phase's graph once more
   in W (DualPipe's WeightGradStore avoids that by deferring only the weight matmuls: a later
   optimisation that changes no schedule). Loss scaling: the last stage backpropagates
   loss_sum / (target tokens of the global batch), gradients accumulate over micro-batches in
   `.grad`, and the MoE auxiliary loss is scaled by 1 / M through `AuxLoss.loss_scale`, so the
   gradients equal a single process running the same micro-batches (tests/test_pipeline.py).

   Communication: sends are asynchronous (isend, waited at the end of the step), receives block
   right before the op that needs them, so a schedule that `simulate` can finish cannot deadlock.
   Activations travel on one process group and gradients on a second one over the same ranks, so
   that between two ranks each (group, direction) carries one stream of micro-batches in order:
   NCCL matches point-to-point messages by order, gloo also by tag (set explicitly here).
"""

from __future__ import annotations

import sys
import time
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pithtrain.distributed import overlap

# ---------------------------------------------------------------------------------------------
# Partitioning


def split_layers(num_layers: int, num_stages: int, override: list | None = None,
                 v_shape: bool = False) -> list[list[int]]:
    """Layer ids per virtual stage. `override`: layers per stage (parallel.pp_layers).
    v_shape (DualPipeV): balance per rank, not per stage (rank r holds stages r and V-1-r; the
    V's turn puts the two middle stages on one rank), then split each rank's share between its
    two chunks, the first chunk taking the odd layer."""
    if override is None and v_shape:
        pp = num_stages // 2
        base, extra = divmod(num_layers, pp)
        per_rank = [base + (1 if 0 < r <= extra else 0) for r in range(pp)]  # rank 0 holds both ends
        override = [0] * num_stages
        for r, n in enumerate(per_rank):
            override[r], override[num_stages - 1 - r] = (n + 1) // 2, n // 2
    if override is not None:
        if len(override) != num_stages or sum(override) != num_layers or min(override) < 0:
            raise ValueError(f"parallel.pp_layers: needs {num_stages} non-negative counts summing to "
                             f"{num_layers} layers, got {override}")
        counts = list(override)
    else:
        base, extra = divmod(num_layers, num_stages)
        counts = [base] * num_stages
        # Stages without the embedding or the head take the remainder, middle first; the ends last.
        middle = sorted(range(1, num_stages - 1), key=lambda s: abs(s - (num_stages - 1) / 2))
        for s in (middle + [0, num_stages - 1])[:extra]:
            counts[s] += 1
    ids, start = [], 0
    for c in counts:
        ids.append(list(range(start, start + c)))
        start += c
    return ids


def num_virtual_stages(pp: int, schedule: str) -> int:
    return 2 * pp if schedule == "dualpipev" else pp


def stage_rank(v: int, pp: int, schedule: str) -> int:
    """The pipeline rank that holds virtual stage v."""
    if schedule == "dualpipev":
        return v if v < pp else 2 * pp - 1 - v
    return v


def rank_stages(rank: int, pp: int, schedule: str) -> list[int]:
    """Virtual stages held by `rank`, indexed by local chunk id."""
    return [rank, 2 * pp - 1 - rank] if schedule == "dualpipev" else [rank]


@dataclass
class Chunk:
    """One virtual stage as held by a rank: which layers, and whether it owns the ends."""
    stage: int
    layer_ids: list[int]
    first: bool  # holds the embedding
    last: bool  # holds norm + head + loss


def rank_chunks(rank: int, pp: int, schedule: str, num_layers: int,
                override: list | None = None) -> list[Chunk]:
    V = num_virtual_stages(pp, schedule)
    layers = split_layers(num_layers, V, override, v_shape=schedule == "dualpipev")
    return [Chunk(v, layers[v], v == 0, v == V - 1) for v in rank_stages(rank, pp, schedule)]


def prune_model(model: torch.nn.Module, chunks: list[Chunk]) -> torch.nn.Module:
    """Drop, in place, every module this rank does not hold. `model.layers` becomes a ModuleDict
    keyed by the layer index, so parameter names stay those of the whole model ("layers.7.mlp...":
    checkpoints and Hugging Face export need no renaming). Works on the meta device; run it
    before `parallelize`."""
    keep = sorted({i for c in chunks for i in c.layer_ids})
    model.layers = torch.nn.ModuleDict({str(i): model.layers[i] for i in keep})
    tied = model.lm_head.weight is model.embed_tokens.weight
    has_first, has_last = any(c.first for c in chunks), any(c.last for c in chunks)
    if tied and has_first != has_last:
        raise ValueError("tie_word_embeddings with the embedding and the head on different pipeline "
                         "ranks is not supported (use parallel.pp_schedule=dualpipev, which keeps "
                         "both on rank 0)")
    if not has_first:
        model.embed_tokens = None
    if not has_last:
        model.norm = None
        model.lm_head = None
    return attach_ends(model)


def _pipeline_begin(self):
    return None


def attach_ends(model: torch.nn.Module) -> torch.nn.Module:
    """The pipeline never calls the model's forward; it calls the layers' phases and the ends
    (overlap.chunk_phases), driving FSDP's gathers itself. `pipeline_begin` (called at each step
    start), hooked by FSDP (`register_fsdp_methods`), lets the root FSDP unit initialise first."""
    model.pipeline_begin = types.MethodType(_pipeline_begin, model)
    return model


def register_fsdp_methods(model: torch.nn.Module):
    """After `parallelize`: FSDP's root hooks around `pipeline_begin`."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    if isinstance(model, FSDPModule):
        register_fsdp_forward_method(model, "pipeline_begin")


# ---------------------------------------------------------------------------------------------
# Schedules


@dataclass(frozen=True)
class Op:
    kind: str  # F B W BW FB SEND_F RECV_F SEND_B RECV_B
    chunk: int  # local chunk id (0, or 0/1 for dualpipev); for SEND/RECV: the chunk it serves
    mb: int
    b_chunk: int = -1  # FB only: the chunk and micro-batch of the backward half
    b_mb: int = -1
    peer: int = -1  # SEND/RECV only

    def __str__(self):
        if self.kind == "FB":
            return f"F{self.chunk}.{self.mb}+BW{self.b_chunk}.{self.b_mb}"
        if self.kind.startswith(("SEND", "RECV")):
            arrow = "->" if self.kind.startswith("SEND") else "<-"
            return f"{self.kind}{self.chunk}.{self.mb}{arrow}r{self.peer}"
        return f"{self.kind}{self.chunk}.{self.mb}"


def schedule_1f1b(pp: int, M: int) -> list[list[Op]]:
    """PipeDream-flush 1F1B: p - r - 1 warm-up forwards, then one forward / one full backward,
    then the cool-down backwards. Bubble (p - 1)(F + B + W) per rank."""
    out = []
    for r in range(pp):
        warm = min(pp - r - 1, M)
        ops = [Op("F", 0, i) for i in range(warm)]
        f, b = warm, 0
        while f < M:
            ops += [Op("F", 0, f), Op("BW", 0, b)]
            f, b = f + 1, b + 1
        ops += [Op("BW", 0, i) for i in range(b, M)]
        out.append(with_comm(ops, r, pp, "1f1b"))
    return out


def schedule_dualpipev(pp: int, M: int) -> list[list[Op]]:
    """DualPipeV (DeepSeek's DualPipe cut in half into a V), in its eight steps per rank r:
      1  2(p-r-1) x F0                    fill the V's left arm
      2  (r+1)   x F0 F1                  reach the turn
      3  (p-r-1) x B1(zb) W F1            zero bubble: the W fills the wait for the next F1
      4  M-2p+r+1 x FB(F0,B1) FB(F1,B0)   steady state: forward of one micro-batch overlapped with
                                          the backward of another (the last rank's first pair is
                                          not overlapped: it would lengthen the critical path)
      5  (p-r-1) x BW1 FB(F1,B0)
      6  (r+1)   x B1 B0                  the second half of these defer W (zero bubble)
      7  (p-r-1) x W B0(zb)
      8  (r+1)   x W                      drain the deferred weight gradients (FIFO)
    B(zb) is an input-only backward whose W comes later; BW is a full backward.
    Bubble (p - 1)(F&B + (B + W) - 3W), the most any rank idles (see the module docstring)."""
    if M < 2 * pp:
        raise ValueError(f"dualpipev needs at least 2 * pp = {2 * pp} micro-batches, got {M}")
    out = []
    for r in range(pp):
        ops, nf, nb, wq = [], [0, 0], [0, 0], []

        def F(c):
            ops.append(Op("F", c, nf[c]))
            nf[c] += 1

        def B(c, zb):
            if zb:
                ops.append(Op("B", c, nb[c]))
                wq.append((c, nb[c]))
            else:
                ops.append(Op("BW", c, nb[c]))
            nb[c] += 1

        def W():
            c, i = wq.pop(0)
            ops.append(Op("W", c, i))

        def FB(cf, cb):
            ops.append(Op("FB", cf, nf[cf], cb, nb[cb]))
            nf[cf] += 1
            nb[cb] += 1

        for _ in range(2 * (pp - r - 1)):
            F(0)
        for _ in range(r + 1):
            F(0)
            F(1)
        for _ in range(pp - r - 1):
            B(1, zb=True)
            W()
            F(1)
        for i in range(M - 2 * pp + r + 1):
            if i == 0 and r == pp - 1:
                F(0)
                B(1, zb=False)
            else:
                FB(0, 1)
            FB(1, 0)
        for _ in range(pp - r - 1):
            B(1, zb=False)
            FB(1, 0)
        zb = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                zb = True
            B(1, zb)
            if i == (r + 1) // 2 and r % 2 == 0:
                zb = True
            B(0, zb)
        for _ in range(pp - r - 1):
            W()
            B(0, zb=True)
        for _ in range(r + 1):
            W()
        assert not wq and nf == [M, M] and nb == [M, M], (r, wq, nf, nb)
        out.append(with_comm(ops, r, pp, "dualpipev"))
    return out


def with_comm(ops: list[Op], rank: int, pp: int, schedule: str) -> list[Op]:
    """Insert the receives each compute op needs (just before it) and the sends it produces (just
    after). A hop between two chunks of the same rank (the turn of the V) needs neither."""
    stages = rank_stages(rank, pp, schedule)
    V = num_virtual_stages(pp, schedule)
    out = []

    def recv_f(c, mb):
        v = stages[c]
        if v > 0 and stage_rank(v - 1, pp, schedule) != rank:
            out.append(Op("RECV_F", c, mb, peer=stage_rank(v - 1, pp, schedule)))

    def send_f(c, mb):
        v = stages[c]
        if v < V - 1 and stage_rank(v + 1, pp, schedule) != rank:
            out.append(Op("SEND_F", c, mb, peer=stage_rank(v + 1, pp, schedule)))

    def recv_b(c, mb):
        v = stages[c]
        if v < V - 1 and stage_rank(v + 1, pp, schedule) != rank:
            out.append(Op("RECV_B", c, mb, peer=stage_rank(v + 1, pp, schedule)))

    def send_b(c, mb):
        v = stages[c]
        if v > 0 and stage_rank(v - 1, pp, schedule) != rank:
            out.append(Op("SEND_B", c, mb, peer=stage_rank(v - 1, pp, schedule)))

    for op in ops:
        if op.kind == "F":
            recv_f(op.chunk, op.mb)
            out.append(op)
            send_f(op.chunk, op.mb)
        elif op.kind in ("B", "BW"):
            recv_b(op.chunk, op.mb)
            out.append(op)
            send_b(op.chunk, op.mb)
        elif op.kind == "FB":
            recv_f(op.chunk, op.mb)
            recv_b(op.b_chunk, op.b_mb)
            out.append(op)
            send_f(op.chunk, op.mb)
            send_b(op.b_chunk, op.b_mb)
        else:
            out.append(op)
    return out


def build_schedule(schedule: str, pp: int, M: int) -> list[list[Op]]:
    if schedule == "1f1b":
        return schedule_1f1b(pp, M)
    if schedule == "dualpipev":
        return schedule_dualpipev(pp, M)
    raise ValueError(f"unknown pipeline schedule {schedule!r} (1f1b, dualpipev)")


def format_schedule(sched: list[list[Op]], comm: bool = False) -> str:
    """One line per rank; compute ops only unless `comm`."""
    lines = []
    for r, ops in enumerate(sched):
        shown = [str(o) for o in ops if comm or not o.kind.startswith(("SEND", "RECV"))]
        lines.append(f"rank {r}: " + " ".join(shown))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Simulation: unit costs, zero-time communication


def simulate(sched: list[list[Op]], schedule: str, F=1.0, B=1.0, W=1.0, FB=None):
    """Replay the compute ops with costs F, B, W per chunk (BW = B + W; FB = F + B + W unless
    given). Returns (makespan, per-rank busy time, per-rank op timeline [(op, start, end)]).
    Raises if the lists deadlock (an op waits on one that can never run)."""
    pp = len(sched)
    FB = F + B + W if FB is None else FB
    cost = {"F": F, "B": B, "W": W, "BW": B + W, "FB": FB}
    V = num_virtual_stages(pp, schedule)
    f_done, b_done = {}, {}  # (virtual stage, mb) -> end time
    ops = [[o for o in s if o.kind in cost] for s in sched]
    pos, clock, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    timeline = [[] for _ in range(pp)]

    def ready(r, op):
        st = rank_stages(r, pp, schedule)
        deps = []
        if op.kind in ("F", "FB"):
            v = st[op.chunk]
            deps.append(f_done.get((v - 1, op.mb)) if v > 0 else 0.0)
        if op.kind in ("B", "BW", "FB"):
            c, mb = (op.b_chunk, op.b_mb) if op.kind == "FB" else (op.chunk, op.mb)
            v = st[c]
            deps.append(b_done.get((v + 1, mb)) if v < V - 1 else f_done.get((v, mb)))
        return None if any(d is None for d in deps) else max(deps, default=0.0)

    while any(pos[r] < len(ops[r]) for r in range(pp)):
        progress = False
        for r in range(pp):
            while pos[r] < len(ops[r]):
                op = ops[r][pos[r]]
                t = ready(r, op)
                if t is None:
                    break
                start = max(clock[r], t)
                end = start + cost[op.kind]
                st = rank_stages(r, pp, schedule)
                if op.kind in ("F", "FB"):
                    f_done[(st[op.chunk], op.mb)] = end
                if op.kind in ("B", "BW"):
                    b_done[(st[op.chunk], op.mb)] = end
                if op.kind == "FB":
                    b_done[(st[op.b_chunk], op.b_mb)] = end
                clock[r], busy[r] = end, busy[r] + cost[op.kind]
                timeline[r].append((op, start, end))
                pos[r] += 1
                progress = True
        if not progress:
            stuck = {r: str(ops[r][pos[r]]) for r in range(pp) if pos[r] < len(ops[r])}
            raise RuntimeError(f"schedule deadlocks; ranks wait at {stuck}")
    return max(clock), busy, timeline


def bubble_formula(schedule: str, pp: int, F=1.0, B=1.0, W=1.0, FB=None) -> float:
    """The idle time the schedule should reach (module docstring): F, B, W per stage for 1F1B,
    per chunk for DualPipeV."""
    if schedule == "1f1b":
        return (pp - 1) * (F + B + W)
    FB = F + B + W if FB is None else FB
    return (pp - 1) * (FB + (B + W) - 3 * W)


# ---------------------------------------------------------------------------------------------
# Executor


def new_pp_groups(pp_rank_lists: list[list[int]]):
    """Two process groups over each pipeline's ranks (global ranks, one list per pipeline):
    activations travel on the first, gradients on the second. Every rank must call this with the
    same lists (torch.distributed creates groups collectively). Returns this rank's pair."""
    mine = []
    for _ in range(2):
        group, _ = dist.new_subgroups_by_enumeration(pp_rank_lists)
        mine.append(group)
    return mine[0], mine[1]


class PipelineRunner:
    """Runs one rank's op list for one optimizer step (module docstring, part 3).

    model: this rank's pruned model (`prune_model`); chunks: its `rank_chunks`; act_shape: the
    (micro-batch, sequence, hidden) shape of the activations between stages, which travel in
    float32 (the residual stream's dtype, also under bf16 autocast). `timeline`, when a list,
    receives {"op", "start", "end"} per compute op (seconds from the step start; on CUDA the device
    is synchronised after each op so the times are the op's, not its launch's)."""

    def __init__(self, model, chunks: list[Chunk], ops: list[Op], pp_rank: int, pp: int, schedule: str,
                 num_micro: int, group_f, group_b, act_shape, device, streams=None, autocast=None,
                 checkpointed: bool = False):
        self.model, self.chunks, self.ops = model, chunks, ops
        self.pp_rank, self.pp, self.schedule, self.M = pp_rank, pp, schedule, num_micro
        self.group_f, self.group_b = group_f, group_b
        self.act_shape, self.device, self.streams = tuple(act_shape), device, streams
        self.autocast = autocast
        self.holds_loss = any(c.last for c in chunks)
        self.V = num_virtual_stages(pp, schedule)
        self.timeline = None
        # Layers run as their phases (overlap.py), and under FSDP the runner drives each layer's
        # gather / reduce-scatter itself, so B defers the weight gradient and its reduce-scatter
        # to W. Activation checkpointing wraps a layer's own call, so checkpointed layers run
        # whole; under FSDP their hooks then reduce in B, so B is a full backward there.
        from torch.distributed.fsdp import FSDPModule
        self.fsdp = isinstance(model, FSDPModule)
        self.split_layers = not checkpointed
        self.split = not (self.fsdp and checkpointed)

    # --- helpers
    def _global(self, group, pp_peer):
        return dist.get_global_rank(group, pp_peer)

    def _tag(self, stage, mb):  # both ends name a message by its receiving stage
        return stage * self.M + mb

    def _local_prev(self, c):  # the previous stage is this rank's other chunk (the V's turn)
        v = self.chunks[c].stage
        return v > 0 and stage_rank(v - 1, self.pp, self.schedule) == self.pp_rank

    def _start_run(self, c, mb):
        chunk = self.chunks[c]
        x_BS, y_BS, positions_BS = self.micro[mb]
        if chunk.first:
            x = x_BS
        elif self._local_prev(c):
            x = self.runs[(c - 1, mb)].output
        else:
            x = self.f_in.pop((c, mb))
        phases = overlap.chunk_phases(self.model, chunk, positions_BS, y_BS if chunk.last else None,
                                      split_layers=self.split_layers)
        run = overlap.start(phases, x, fsdp=self.fsdp, mb=mb, chunk=c, timeline=self.phase_log)
        self.runs[(c, mb)] = run
        return run

    def _grad_out(self, c, mb):
        if self.chunks[c].last:
            return self.loss_grad
        if (c + 1 < len(self.chunks)) and self._local_prev(c + 1):
            return self.local_grad.pop((c, mb))
        return self.b_in.pop((c, mb))

    def _after_forward(self, c, mb):
        if self.chunks[c].last:
            self.loss_sum = self.loss_sum + self.runs[(c, mb)].output.detach()

    def _after_backward(self, c, mb, full: bool):
        run = self.runs[(c, mb)]
        g = run.input_grad()
        if not self.chunks[c].first:
            if self._local_prev(c):
                self.local_grad[(c - 1, mb)] = g
            else:
                self.b_out[(c, mb)] = g
        run.grads.clear()
        if full:
            del self.runs[(c, mb)]

    # --- one step
    def step(self, micro_batches, denom: float) -> float:
        """micro_batches: M (input ids, labels[, positions]) on the device (every rank gets them;
        the first stage reads the ids, the last the labels). Returns this rank's summed token
        loss (non-zero only where the last stage lives: a sum over ranks gives the total)."""
        assert len(micro_batches) == self.M
        micro_batches = [(x, y, pos[0] if pos and pos[0] is not None
                          else torch.arange(x.shape[1], device=x.device).expand_as(x))
                         for x, y, *pos in micro_batches]
        self.micro, self.runs, self.f_in, self.b_in, self.b_out, self.local_grad = micro_batches, {}, {}, {}, {}, {}
        self.loss_sum = torch.zeros((), device=self.device)
        self.loss_grad = torch.tensor(1.0 / denom, device=self.device)
        pending = []
        if hasattr(self.model, "pipeline_begin"):
            self.model.pipeline_begin()
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        self.phase_log = [] if self.timeline is not None else None
        origin = None
        if cuda and self.timeline is not None:
            origin = torch.cuda.Event(enable_timing=True)
            origin.record()
        for op in self.ops:
            k, c, mb = op.kind, op.chunk, op.mb
            if k in ("RECV_F", "RECV_B"):
                buf = torch.empty(self.act_shape, dtype=torch.float32, device=self.device)
                group = self.group_f if k == "RECV_F" else self.group_b
                dist.irecv(buf, src=self._global(group, op.peer), group=group,
                           tag=self._tag(self.chunks[c].stage, mb)).wait()
                if k == "RECV_F":
                    self.f_in[(c, mb)] = buf.requires_grad_()
                else:
                    self.b_in[(c, mb)] = buf
                continue
            if k in ("SEND_F", "SEND_B"):
                if k == "SEND_F":
                    t, group, dest = self.runs[(c, mb)].output.detach(), self.group_f, self.chunks[c].stage + 1
                else:
                    t, group, dest = self.b_out.pop((c, mb)), self.group_b, self.chunks[c].stage - 1
                t = t.float().contiguous()
                pending.append((dist.isend(t, dst=self._global(group, op.peer), group=group,
                                           tag=self._tag(dest, mb)), t))
                continue
            start, n_logged = time.perf_counter() - t0, len(self.phase_log or ())
            with self.autocast if self.autocast is not None else _null():
                self._compute(op)
            if self.timeline is not None:
                if cuda:
                    torch.cuda.synchronize(self.device)
                self.timeline.append({"op": str(op), "kind": k, "start": start,
                                      "end": time.perf_counter() - t0})
                for e in self.phase_log[n_logged:]:
                    e["op"] = str(op)
        for work, _ in pending:
            work.wait()
        if self.fsdp:
            overlap.finish_fsdp(self.model)
        if self.timeline is not None:
            if cuda:
                torch.cuda.synchronize(self.device)
            overlap.resolve_timeline(self.phase_log, t0, origin)
            self.phases_timeline = self.phase_log
        assert not self.runs and not self.f_in and not self.b_in and not self.b_out, "schedule left work"
        return float(self.loss_sum)

    def _compute(self, op: Op):
        k, c, mb = op.kind, op.chunk, op.mb
        if k == "F":
            overlap.forward(self._start_run(c, mb))
            self._after_forward(c, mb)
        elif k in ("B", "BW"):
            input_only = k == "B" and self.split
            overlap.backward(self.runs[(c, mb)], self._grad_out(c, mb), input_only=input_only)
            self._after_backward(c, mb, full=not input_only)
        elif k == "W":
            if self.split:
                overlap.weight_backward(self.runs.pop((c, mb)))
        elif k == "FB":
            f = self._start_run(c, mb)
            g = self._grad_out(op.b_chunk, op.b_mb)
            overlap.forward_backward(f, self.runs[(op.b_chunk, op.b_mb)], g, self.streams)
            self._after_forward(c, mb)
            self._after_backward(op.b_chunk, op.b_mb, full=True)
        else:
            raise ValueError(f"unknown op {op}")


# ---------------------------------------------------------------------------------------------
# The trainer's three calls (train.py): prepare before parallelize, runner after materialise


def prepare(model, cfg, dims) -> list[Chunk]:
    """Check the pipeline settings and prune the (meta) model to this rank's chunks."""
    from pithtrain.config import ConfigError
    p, t = cfg.parallel, cfg.train
    if p.pp_microbatches not in (0, t.grad_accum):
        raise ConfigError(f"{cfg.source}: parallel.pp_microbatches: the pipeline runs the step's "
                          f"train.grad_accum = {t.grad_accum} micro-batches; set 0 or {t.grad_accum}")
    if p.pp_schedule == "dualpipev" and t.grad_accum < 2 * p.pp:
        raise ConfigError(f"{cfg.source}: train.grad_accum: dualpipev needs at least 2 * pp = "
                          f"{2 * p.pp} micro-batches, got {t.grad_accum}")
    if dims.cp_enabled:
        raise ConfigError(f"{cfg.source}: parallel.cp: pipeline x context parallel is not wired yet")
    try:
        chunks = rank_chunks(dims.pp_rank, p.pp, p.pp_schedule, cfg.model.num_layers, p.pp_layers)
        prune_model(model, chunks)
    except ValueError as e:
        raise ConfigError(f"{cfg.source}: {e}") from None
    return chunks


def make_runner(model, chunks, cfg, dims, device, autocast=None) -> "PipelineRunner":
    """After parallelize + materialise: FSDP hooks on the end methods, the two P2P groups, the op
    list of this rank."""
    p, t = cfg.parallel, cfg.train
    register_fsdp_methods(model)
    per_stage = dims.world_size // p.pp  # ranks are (pp, ...) row-major: stage s = one block
    group_f, group_b = new_pp_groups([[s * per_stage + j for s in range(p.pp)] for j in range(per_stage)])
    ops = build_schedule(p.pp_schedule, p.pp, t.grad_accum)[dims.pp_rank]
    streams = overlap.Streams(device) if device.type == "cuda" and p.pp_overlap else None
    return PipelineRunner(model, chunks, ops, dims.pp_rank, p.pp, p.pp_schedule, t.grad_accum,
                          group_f, group_b, (t.micro_batch_size, t.seq_len, cfg.model.hidden_size),
                          device, streams, autocast, checkpointed=t.activation_checkpoint != "none")


def run_step(runner: "PipelineRunner", micro_batches, denom: float, cfg, dims, step: int):
    """The forward and backward of one optimizer step; returns (this rank's summed token loss,
    its token count), both zero off the last stage, so the trainer's sum over ranks is right.
    The last step of a run records its timeline (pipeline_viz draws it)."""
    record = step + 1 == cfg.train.steps
    runner.timeline = [] if record else None
    loss = runner.step(micro_batches, denom)
    if record:
        save_timeline(runner.timeline, cfg.log.run_dir, dims.rank, dims.pp_rank, step + 1,
                      runner.phases_timeline)
    n_tokens = sum(mb[1].numel() for mb in micro_batches) if runner.holds_loss else 0
    return loss, n_tokens


def save_timeline(timeline: list, run_dir, rank: int, pp_rank: int, step: int, phases: list = ()):
    """<run_dir>/pipeline_timeline/rank<R>.json, read by `python -m pithtrain.pipeline_viz`:
    "ops" one entry per schedule op (op, kind, start, end: seconds from the step start), "phases"
    one per phase run (overlap.py's timeline: phase, comm, mb, chunk, pass_, stream, pair, op,
    start, end)."""
    import json
    from pathlib import Path
    d = Path(run_dir) / "pipeline_timeline"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "pp_rank": pp_rank, "step": step, "ops": timeline, "phases": list(phases)},
        indent=0))


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------------------------
# Print a schedule: python -m pithtrain.distributed.pipeline SCHEDULE PP MICROBATCHES


if __name__ == "__main__":
    name, pp_, m_ = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    s_ = build_schedule(name, pp_, m_)
    print(format_schedule(s_, comm="--comm" in sys.argv))
    mk_, busy_, _ = simulate(s_, name)
    print(f"F = B = W = 1: makespan {mk_:g}, idle per rank {[round(mk_ - b, 3) for b in busy_]}, "
          f"formula {bubble_formula(name, pp_):g}")
