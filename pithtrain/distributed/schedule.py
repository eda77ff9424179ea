"""Pipeline schedules as plain data, torch-free: partitioning, per-rank op lists, a simulator and
the overlap cost model (the executor that runs the lists is pipeline.py).

    python -m pithtrain.distributed.schedule dualpipev 4 8            # print a schedule and its bubble

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
   step computes the same numbers); on CPU the same ops run in order on one thread. Under FSDP
   the executor drives each layer's gathers and defers its reduce-scatter to W (overlap.py), so
   the B/W split and the overlap hold in pp x fsdp x ep and pp x dp x ep too.

The performance model (pithtrain/perf.py) runs `simulate` with measured chunk costs: the F, B, W
and F&B of a layout's chunks, communication included, give its pipeline step and bubble.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass

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
        override = [(n + 1) // 2 for n in per_rank] + [n // 2 for n in reversed(per_rank)]  # stages r, V-1-r
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
    return [list(range(start, start + c)) for start, c in zip(itertools.accumulate(counts, initial=0), counts)]


def num_virtual_stages(pp: int, schedule: str) -> int:
    return 2 * pp if schedule == "dualpipev" else pp


def stage_rank(v: int, pp: int, schedule: str) -> int:
    """The pipeline rank that holds virtual stage v."""
    return 2 * pp - 1 - v if schedule == "dualpipev" and v >= pp else v


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
        for f in range(warm, M):
            ops += [Op("F", 0, f), Op("BW", 0, f - warm)]
        ops += [Op("BW", 0, i) for i in range(M - warm, M)]
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
        for i in range(r + 1):  # the second half of these 2(r + 1) backwards defer W
            B(1, zb=2 * i >= r + 1)
            B(0, zb=2 * i + 1 >= r + 1)
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

    def comm(kind, c, mb, dv):  # the op when the stage dv away (-1: previous, +1: next) is another rank's
        v = stages[c] + dv
        if 0 <= v < V and stage_rank(v, pp, schedule) != rank:
            out.append(Op(kind, c, mb, peer=stage_rank(v, pp, schedule)))

    for op in ops:
        f = [(op.chunk, op.mb)] if op.kind in ("F", "FB") else []  # its forward's and backward's (chunk, mb)
        b = [(op.b_chunk, op.b_mb)] if op.kind == "FB" else [(op.chunk, op.mb)] if op.kind in ("B", "BW") else []
        sides = [("F", c, mb, +1) for c, mb in f] + [("B", c, mb, -1) for c, mb in b]  # +1: activations go on
        for side, c, mb, d in sides:
            comm("RECV_" + side, c, mb, -d)
        out.append(op)
        for side, c, mb, d in sides:
            comm("SEND_" + side, c, mb, d)
    return out


def build_schedule(schedule: str, pp: int, M: int) -> list[list[Op]]:
    if schedule == "1f1b":
        return schedule_1f1b(pp, M)
    if schedule == "dualpipev":
        return schedule_dualpipev(pp, M)
    raise ValueError(f"unknown pipeline schedule {schedule!r} (1f1b, dualpipev)")


def format_schedule(sched: list[list[Op]], comm: bool = False) -> str:
    """One line per rank; compute ops only unless `comm`."""
    return "\n".join(f"rank {r}: " + " ".join(str(o) for o in ops if comm or not o.kind.startswith(("SEND", "RECV")))
                     for r, ops in enumerate(sched))


# ---------------------------------------------------------------------------------------------
# Simulation: unit costs, zero-time communication


def simulate(sched: list[list[Op]], schedule: str, F=1.0, B=1.0, W=1.0, FB=None):
    """Replay the compute ops with costs F, B, W per chunk (BW = B + W; FB = F + B + W unless
    given). Each cost is one number, or a list indexed by virtual stage (FB then a function of
    the forward's and the backward's stages). Returns (makespan, per-rank busy time, per-rank op
    timeline [(op, start, end)]). Raises if the lists deadlock (an op waits on one that can never run)."""
    pp = len(sched)
    V = num_virtual_stages(pp, schedule)
    F, B, W = ([x] * V if not isinstance(x, list) else x for x in (F, B, W))
    pair = FB if callable(FB) else None

    def cost(op, st):
        v = st[op.chunk]
        if op.kind != "FB":
            return {"F": F[v], "B": B[v], "W": W[v], "BW": B[v] + W[v]}[op.kind]
        vb = st[op.b_chunk]
        return pair(v, vb) if pair else F[v] + B[vb] + W[vb] if FB is None else FB  # None: nothing overlaps
    f_done, b_done = {}, {}  # (virtual stage, mb) -> end time
    ops = [[o for o in s if o.kind in ("F", "B", "W", "BW", "FB")] for s in sched]
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
                st = rank_stages(r, pp, schedule)
                end = start + cost(op, st)
                if op.kind in ("F", "FB"):
                    f_done[(st[op.chunk], op.mb)] = end
                if op.kind in ("B", "BW"):
                    b_done[(st[op.chunk], op.mb)] = end
                if op.kind == "FB":
                    b_done[(st[op.b_chunk], op.b_mb)] = end
                clock[r], busy[r] = end, busy[r] + end - start
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


if __name__ == "__main__":
    name, pp_, m_ = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    s_ = build_schedule(name, pp_, m_)
    print(format_schedule(s_, comm="--comm" in sys.argv))
    mk_, busy_, _ = simulate(s_, name)
    print(f"F = B = W = 1: makespan {mk_:g}, idle per rank {[round(mk_ - b, 3) for b in busy_]}, "
          f"formula {bubble_formula(name, pp_):g}")
