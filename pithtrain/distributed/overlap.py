"""A pipeline chunk as a list of phases, and the overlapped forward-backward step (DualPipeV's F&B).

A chunk (embedding?, some decoder layers, norm + head + loss?) runs as a flat list of `Phase`s.
Each decoder layer contributes its own `DecoderLayer.phases` (models/common.py, the code its
`forward` runs, so the two cannot drift); a MoE layer of any family has six:

    attn      compute  h -> h1 = h + attention(norm(h)), x = norm(h1)
    route     compute  x -> top-k weights and ids (and the load-balancing loss)
    dispatch  comm     rows to their experts (expert parallel: the all-to-all)
    experts   compute  grouped experts (+ shared experts)
    combine   comm     weighted rows back to their tokens (expert parallel: the all-to-all back)
    residual  compute  h1 + moe output

A dense layer has two (attn, mlp). With activation checkpointing a layer is one phase calling
`layer(h, rope)` (the checkpoint wraps the layer's own call), which only gives up overlap there.

Autograd is cut at every phase boundary: each phase reads detached copies of its inputs ("leaves")
and records (leaves, outputs). A forward phase runs under the run's autocast (precision.Precision
.autocast), a backward one outside it, as train.py's step runs them. Backward walks the records in
reverse, calling autograd per phase with the output gradients collected so far, and hands each
leaf's gradient to the phase that
produced it. That gives three backward modes from one mechanism: full (BW), input-only (B: autograd
.grad w.r.t. the leaves, graph retained, output gradients saved) and weight-only (W: autograd
.backward w.r.t. the phase's parameters with the saved gradients).

FSDP. The phases call a layer's parts, not the layer, so FSDP2's hooks (around a module's own
call) never fire; the chunk drives FSDP itself (`fsdp=True`), per layer ("unit": the layer and its
separately sharded experts, and the root for embedding / head):
    forward    all-gather (unshard) before the unit's first phase, prefetch the next unit's
               all-gather (async, FSDP's all-gather stream), free (reshard) after its last phase;
    backward   all-gather again before the unit's phases; a full backward (BW) reduce-scatters the
               unit's gradients right after them, an input-only B leaves the weights gathered and
               the reduce-scatter to W, which runs the weight gradients and then reduce-scatters.
Gradients are reduce-scattered as they complete (reduce-scatter is linear: partial sums add up), so
the order of B and W across micro-batches does not matter. `finish_fsdp` ends a step.

`forward_backward(f, b)` runs the forward of one micro-batch and the full backward of another with
their phases interleaved: when one side's next phase is communication and the other's is compute,
the communication phase is issued on the communication CUDA stream and the compute phase on the
compute stream, so the all-to-all of one micro-batch runs under the other's matmuls. Each side is
a chain: before a phase starts, its stream waits on the event recorded after that side's previous
phase (events are transitive, so every earlier output of the same side is ready). Tensors the
backward side frees mid-step are held until the end, where the two streams wait on each other, so
no memory made on one stream is reused while the other may still read it. On CPU (or
`streams=None`) the identical interleaving runs in order on one thread.

Timeline: a run given a `timeline` list appends one entry per phase executed: phase name, comm,
micro-batch, chunk, pass (F, B, W, BW), stream, pair (the index of the F&B pairing step it was
issued in, or None), start / end in seconds (CUDA: from events, resolved by `resolve_timeline`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.distributed.fsdp import FSDPModule

from pithtrain.models.common import DecoderLayer, Phase, head_loss

# ---------------------------------------------------------------------------------------------
# Phases


def chunk_phases(model, chunk, positions_BS, labels_BS=None, split_layers: bool = True) -> list[Phase]:
    """The phases of one chunk (pipeline.Chunk) on one micro-batch. State names: 'in' is the
    chunk input (token ids or hidden states), 'out' its output (hidden states, or the summed token
    loss on the last stage); layer i's values are named "i.<name>". split_layers=False (activation
    checkpointing): one phase per layer, `layer(h, rope)`."""
    rope = model.rotary(positions_BS)
    phases, cur = [], "in"
    if chunk.first:
        phases.append(Phase("embed", False, lambda **s: {"h.e": model.embed_tokens(s["in"])}, ("in",),
                            lambda: list(model.embed_tokens.parameters()), model))
        cur = "h.e"
    for i in chunk.layer_ids:
        layer = model.layers[str(i)] if isinstance(model.layers, torch.nn.ModuleDict) else model.layers[i]
        if split_layers and isinstance(layer, DecoderLayer):
            phases += [_renamed(ph, i, cur) for ph in layer.phases(rope)]
        else:
            phases.append(Phase(f"layer{i}", False,
                                lambda h_in=cur, out=f"{i}.out", layer=layer, **s: {out: layer(s[h_in], rope)},
                                (cur,), lambda layer=layer: list(layer.parameters()), None))
        cur = f"{i}.out"
    if chunk.last:
        def head(h_in=cur, **s):
            return {"out": head_loss(model, s[h_in], labels_BS)}
        phases.append(Phase("head", False, head, (cur,),
                            lambda: [*model.norm.parameters(), *model.lm_head.parameters()], model))
    else:
        phases.append(Phase("out", False, lambda h_in=cur, **s: {"out": s[h_in]}, (cur,), list, None))
    return phases


def _renamed(ph: Phase, i: int, h_in: str) -> Phase:
    """Layer i's phase over the chunk's state: its "h" is `h_in`, every other name is "i.name"."""
    def key(n):
        return h_in if n == "h" else f"{i}.{n}"

    def fn(**s):
        return {key(n): v for n, v in ph.fn(**{n: s[key(n)] for n in ph.inputs}).items()}
    return Phase(f"{ph.name}{i}", ph.comm, fn, tuple(key(n) for n in ph.inputs), ph.params, ph.unit)


# ---------------------------------------------------------------------------------------------
# FSDP units: gather / free / reduce a layer's parameters around its phases


def _units(unit):
    """The FSDP modules whose parameters a unit's phases use: the layer (or root) itself and any
    module sharded separately inside it (routed experts), but not other layers (the root's
    modules() holds every layer; its own parameters are embedding, norm and head)."""
    if isinstance(unit, DecoderLayer):
        return [m for m in unit.modules() if isinstance(m, FSDPModule)]
    return [unit] if isinstance(unit, FSDPModule) else []


def gather(unit, async_op: bool = False):
    for m in _units(unit):
        m.unshard(async_op=async_op)


def free(unit):
    for m in _units(unit):
        m.reshard()


def reduce_grads(unit):
    """Reduce-scatter (and, under HSDP, all-reduce) the gathered gradients of the unit into its
    sharded `.grad`s (accumulating), then free the gathered weights: FSDP's own post-backward."""
    for m in _units(unit):
        for group in m._get_fsdp_state()._fsdp_param_groups:
            group.post_backward()


def finish_fsdp(model):
    """End of a step under driven FSDP: FSDP's end-of-backward callback (waits for the pending
    reduce-scatters, resets every unit's state for the next step)."""
    if isinstance(model, FSDPModule):
        model._get_fsdp_state()._root_post_backward_final_callback()


# ---------------------------------------------------------------------------------------------
# One chunk on one micro-batch


def _leaf(t):
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.detach().requires_grad_(t.requires_grad)
    return t


@dataclass
class ChunkRun:
    """The forward records and backward state of one chunk on one micro-batch."""
    phases: list
    state: dict  # name -> tensor, filled by the forward
    records: list = field(default_factory=list)  # per phase: (leaves, outputs)
    grads: dict = field(default_factory=dict)  # name -> gradient collected so far
    saved: list = field(default_factory=list)  # input-only backward: (phase index, outputs, grads)
    fsdp: bool = False  # drive FSDP's gather / reduce per unit (module docstring)
    autocast: Callable = contextlib.nullcontext  # the forward phases' context (precision.Precision.autocast)
    mb: int = 0  # for the timeline
    chunk: int = 0
    timeline: list | None = None

    @property
    def output(self):
        return self.state["out"]

    def first_of_unit(self, k):
        return k == 0 or self.phases[k - 1].unit is not self.phases[k].unit

    def last_of_unit(self, k):
        return k == len(self.phases) - 1 or self.phases[k + 1].unit is not self.phases[k].unit


def start(phases, x, fsdp: bool = False, mb: int = 0, chunk: int = 0, timeline=None,
          autocast: Callable = contextlib.nullcontext) -> ChunkRun:
    return ChunkRun(phases, {"in": x}, fsdp=fsdp, mb=mb, chunk=chunk, timeline=timeline, autocast=autocast)


def forward_phase(run: ChunkRun, k: int):
    ph = run.phases[k]
    if run.fsdp and ph.unit is not None:
        gather(ph.unit)  # a no-op when gathered; also re-gathers what an earlier step freed
        if run.first_of_unit(k):
            nxt = next((p.unit for p in run.phases[k + 1:] if p.unit is not ph.unit), None)
            gather(nxt, async_op=True)  # prefetch: the next unit's all-gather under this unit
    leaves = {n: _leaf(run.state[n]) for n in ph.inputs}
    with run.autocast():
        outs = ph.fn(**leaves)
    run.state.update(outs)
    run.records.append((leaves, outs))
    if run.fsdp and run.last_of_unit(k):
        free(ph.unit)


def backward_phase(run: ChunkRun, k: int, input_only: bool = False, hold: list | None = None):
    """Backward through phase k (phases are walked from the last). Full: parameter and leaf
    gradients at once. Input-only: leaf gradients, graph retained, output gradients saved for W.
    hold: receives the phase's tensors instead of freeing them (two streams: see forward_backward)."""
    ph = run.phases[k]
    if run.fsdp:
        gather(ph.unit)
    leaves, outs = run.records[k]
    pairs = [(t, run.grads.pop(n)) for n, t in outs.items()
             if n in run.grads and isinstance(t, torch.Tensor) and t.requires_grad]
    want = [(n, t) for n, t in leaves.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if pairs:
        ts, gs = zip(*pairs)
        if input_only:
            got = torch.autograd.grad(ts, [t for _, t in want], gs, retain_graph=True,
                                      allow_unused=True) if want else []
            run.saved.append((k, ts, gs))
        else:
            torch.autograd.backward(ts, gs)
            got = [t.grad for _, t in want]
        for (n, _), g in zip(want, got):
            if g is not None:
                run.grads[n] = run.grads[n] + g if n in run.grads else g
    if hold is not None:
        hold.append((run.records[k], pairs, want))
    if not input_only:
        run.records[k] = None  # free the phase's graph and activations
        if run.fsdp and run.first_of_unit(k):
            reduce_grads(ph.unit)  # the unit's backward is complete


def weight_backward(run: ChunkRun):
    """W: the parameter gradients of an earlier input-only backward (then, under FSDP, each
    unit's reduce-scatter once its last phase is done)."""
    t0 = mark(run.state["in"].is_cuda) if run.timeline is not None else None  # timed only when recorded
    for k, ts, gs in run.saved:
        ph = run.phases[k]
        if run.fsdp:
            gather(ph.unit)
        params = [p for p in ph.params() if p.requires_grad]
        if params:
            torch.autograd.backward(ts, gs, inputs=params)
        if run.fsdp and run.first_of_unit(k):
            reduce_grads(ph.unit)
    if run.timeline is not None and run.saved:
        run.timeline.append(dict(phase="W", comm=False, mb=run.mb, chunk=run.chunk, pass_="W",
                                 stream="compute", pair=None, start=t0, end=mark(run.state["in"].is_cuda)))
    run.saved.clear()
    run.records.clear()


def _record(run: ChunkRun, k: int, pass_: str, fn, streams=None, pair=None):
    """Run fn (one phase of run) and, when the run keeps a timeline, log it (module docstring):
    on CUDA its device time, from events on the stream the phase runs on (one stream: the current one)."""
    if run.timeline is None:
        fn()
        return
    ph, cuda = run.phases[k], run.state["in"].is_cuda
    stream = None if streams is None else streams.comm if ph.comm else streams.compute
    start = mark(cuda, stream)
    fn()
    run.timeline.append(dict(phase=ph.name, comm=ph.comm, mb=run.mb, chunk=run.chunk, pass_=pass_,
                             stream="comm" if streams is not None and ph.comm else "compute", pair=pair,
                             start=start, end=mark(cuda, stream)))


def forward(run: ChunkRun):
    for k in range(len(run.phases)):
        _record(run, k, "F", lambda k=k: forward_phase(run, k))


def backward(run: ChunkRun, grad_out, input_only: bool = False):
    run.grads["out"] = grad_out.to(run.output.dtype)
    for k in reversed(range(len(run.phases))):
        _record(run, k, "B" if input_only else "BW", lambda k=k: backward_phase(run, k, input_only))


def mark(cuda: bool, stream=None):
    """A point on a step's timeline: a CUDA event recorded on `stream` (None: the current one), or
    the host clock (resolve_timeline turns both into seconds from the step start)."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def resolve_timeline(timeline: list, t0: float, origin=None):
    """Entries' start / end as seconds from the step start: CPU times are perf_counter values
    (minus t0); CUDA events are measured from `origin` (an event recorded at the step start)."""
    for e in timeline:
        for key in ("start", "end"):
            e[key] = e[key] - t0 if isinstance(e[key], float) else origin.elapsed_time(e[key]) / 1e3


# ---------------------------------------------------------------------------------------------
# The overlapped forward-backward step


class Streams:
    """The compute stream (current at construction) and one communication stream, on CUDA."""

    def __init__(self, device: torch.device):
        self.compute = torch.cuda.current_stream(device)
        self.comm = torch.cuda.Stream(device)


class _Chain:
    event = None


def _issue(streams, comm: bool, chain: _Chain, fn):
    """Run fn on its stream after the previous phase of its side."""
    if streams is None:
        fn()
        return
    s = streams.comm if comm else streams.compute
    if chain.event is not None:
        s.wait_event(chain.event)
    with torch.cuda.stream(s):
        fn()
    chain.event = torch.cuda.Event()
    chain.event.record(s)


@functools.lru_cache(maxsize=None)  # a pure function of the two patterns: once per chunk pair, not per micro-batch
def pair_plan(f_comm: tuple[bool, ...], b_comm: tuple[bool, ...]) -> tuple[str, ...]:
    """The interleaving of a forward (phases in order) and a backward (phases in reverse order),
    as steps "P" (one phase of each side together: one is communication, the other compute),
    "F" or "B" (one side alone). Dynamic programming over (forward phases done, backward phases
    done): the fewest communication phases left alone (not under the other side's compute), then
    the fewest steps; ties go to the backward side first (its input gradient is what the previous
    stage waits for)."""
    n, m = len(f_comm), len(b_comm)
    best, move = {(n, m): (0, 0)}, {}  # best[i, j]: (communication phases alone, steps) from (i, j) on
    for i in range(n, -1, -1):
        for j in range(m, -1, -1):
            if i == n and j == m:
                continue
            options = []  # (cost from where the step leads, its communication alone, tie order, step)
            if j < m:
                options.append((best[i, j + 1], b_comm[j], 0, "B"))
            if i < n and j < m and f_comm[i] != b_comm[j]:
                options.append((best[i + 1, j + 1], 0, 1, "P"))
            if i < n:
                options.append((best[i + 1, j], f_comm[i], 2, "F"))
            (alone, steps), extra, _, mv = min(options, key=lambda o: (o[0][0] + o[1], o[0][1], o[2]))
            best[i, j], move[i, j] = (alone + extra, steps + 1), mv
    plan, i, j = [], 0, 0
    while (i, j) != (n, m):
        mv = move[i, j]
        plan.append(mv)
        i, j = i + (mv in "PF"), j + (mv in "PB")
    return tuple(plan)


def forward_backward(f: ChunkRun, b: ChunkRun, grad_out, streams: Streams | None = None):
    """Forward all phases of `f` and fully backward all phases of `b`, interleaved by `pair_plan`:
    each pair is a communication phase of one side and a compute phase of the other. Returns the
    steps as [(forward phase name or None, backward phase name or None)] for tests; the timeline
    records the same pairs."""
    b.grads["out"] = grad_out.to(b.output.dtype)
    fc, bc, order = _Chain(), _Chain(), []
    # A tensor made on one stream and last read on the other must not return to the allocator
    # before the reader is done: the backward side's tensors are held until the final barrier.
    hold = [] if streams is not None else None

    def run_f(k, pair):
        _record(f, k, "F", lambda: _issue(streams, f.phases[k].comm, fc, lambda: forward_phase(f, k)),
                streams, pair)

    def run_b(k, pair):
        _record(b, k, "BW", lambda: _issue(streams, b.phases[k].comm, bc, lambda: backward_phase(b, k, hold=hold)),
                streams, pair)

    b_order = list(reversed(range(len(b.phases))))
    fi = bj = 0
    for step in pair_plan(tuple(ph.comm for ph in f.phases), tuple(b.phases[k].comm for k in b_order)):
        fph = f.phases[fi] if step in "PF" else None
        bk = b_order[bj] if step in "PB" else None
        if step == "P":
            # Issue the communication side first so that it starts as early as possible.
            if fph.comm:
                run_f(fi, len(order))
                run_b(bk, len(order))
            else:
                run_b(bk, len(order))
                run_f(fi, len(order))
        elif step == "F":
            run_f(fi, None)
        else:
            run_b(bk, None)
        order.append((fph.name if fph is not None else None, b.phases[bk].name if bk is not None else None))
        fi, bj = fi + (step in "PF"), bj + (step in "PB")
    if streams is not None:
        streams.compute.wait_stream(streams.comm)
        streams.comm.wait_stream(streams.compute)
        hold.clear()
    return order
