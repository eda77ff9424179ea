"""A pipeline chunk as a list of phases, and the overlapped forward-backward step (DualPipeV's F&B).

A chunk (embedding?, some decoder layers, norm + head + loss?) runs as a flat list of `Phase`s.
A Qwen3-MoE layer has five:

    attn      compute  h -> h1 = h + attention(norm(h)); x = norm(h1); router (weights, top-k ids)
    dispatch  comm     x, ids -> expert-contiguous rows (expert parallel: the all-to-all)
    experts   compute  rows -> grouped SwiGLU experts
    combine   comm     rows, weights -> tokens (expert parallel: the all-to-all back)
    post      compute  h1 + moe output

With the expert-parallel dispatcher (one call: all-to-all, experts, all-to-all back) dispatch +
experts + combine are one communication phase "moe" (its experts then run on the communication
stream too; splitting that dispatcher into dispatch / combine methods would let them move back).
Today expert parallel always comes with FSDP (ep borrows fsdp ranks), which runs layers whole, so
the five-phase split runs with the local dispatcher. Any other layer (dense MLP, other families,
or any layer under FSDP: split_layers=False) is one compute phase calling `layer(h, rope)`, which is
always correct and only gives up overlap inside that layer. The phase code restates
common.DecoderLayer.forward / qwen3_moe.MoE.forward (same calls, in the same order; the load-balancing
gradient is attached to h1 instead of the MoE output, which is the same gradient because both feed
the residual stream); tests/test_overlap.py checks it against the model's own forward and backward.

Autograd is cut at every phase boundary: each phase reads detached copies of its inputs ("leaves")
and records (leaves, outputs). Backward walks the records in reverse, calling autograd per phase
with the output gradients collected so far, and hands each leaf's gradient to the phase that
produced it. That gives three backward modes from one mechanism: full (BW), input-only (B: autograd
.grad w.r.t. the leaves, graph retained, output gradients saved) and weight-only (W: autograd
.backward w.r.t. the phase's parameters with the saved gradients).

`forward_backward(f, b)` runs the forward of one micro-batch and the full backward of another with
their phases interleaved: when one side's next phase is communication and the other's is compute,
the communication phase is issued on the communication CUDA stream and the compute phase on the
compute stream, so the all-to-all of one micro-batch runs under the other's matmuls. Each side is
a chain: before a phase starts, its stream waits on the event recorded after that side's previous
phase (events are transitive, so every earlier output of the same side is ready). Tensors the
backward side frees mid-step are held until the end, where the two streams wait on each other, so
no memory made on one stream is reused while the other may still read it. On CPU (or
`streams=None`) the identical interleaving runs in order on one thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from pithtrain.models import qwen3_moe
from pithtrain.models.common import AuxLoss, DecoderLayer, cross_entropy_sum, route_tokens


# ---------------------------------------------------------------------------------------------
# Phases


@dataclass
class Phase:
    name: str
    comm: bool  # communication: runs on the communication stream in forward_backward
    fn: Callable  # (**inputs) -> dict of outputs
    inputs: tuple
    params: list  # parameters whose gradient this phase produces (for W)


def chunk_phases(model, chunk, positions_BS, labels_BS=None, split_layers: bool = True) -> list[Phase]:
    """The phases of one chunk (pipeline.Chunk) on one micro-batch. State names: 'in' is the
    chunk input (token ids or hidden states), 'out' its output (hidden states, or the summed token
    loss on the last stage). split_layers=False: one phase per layer (`layer(h, rope)`), which
    FSDP needs: its hooks gather a layer's weights around the layer's own forward call."""
    rope = model.rotary(positions_BS)
    phases, cur = [], "in"
    embed = getattr(model, "pipeline_embed", None) or model.embed_tokens  # pipeline.attach_ends
    if chunk.first:
        phases.append(Phase("embed", False, lambda **s: {"h.e": embed(s["in"])}, ("in",),
                            list(model.embed_tokens.parameters())))
        cur = "h.e"
    for i in chunk.layer_ids:
        layer = model.layers[str(i)] if isinstance(model.layers, torch.nn.ModuleDict) else model.layers[i]
        layer_phases, cur = _layer_phases(layer, i, cur, rope, split_layers)
        phases += layer_phases
    if chunk.last:
        def head(h_in=cur, **s):
            if hasattr(model, "pipeline_head"):
                return {"out": model.pipeline_head(s[h_in], labels_BS)}
            h = model.norm(s[h_in])
            return {"out": cross_entropy_sum(h.flatten(0, 1), model.lm_head.weight, labels_BS.flatten())}
        phases.append(Phase("head", False, head, (cur,),
                            [*model.norm.parameters(), *model.lm_head.parameters()]))
    else:
        phases.append(Phase("out", False, lambda h_in=cur, **s: {"out": s[h_in]}, (cur,), []))
    return phases


def _layer_phases(layer, i, h_in, rope, split):
    p = f"{i}."
    if not (split and isinstance(layer, DecoderLayer) and isinstance(layer.mlp, qwen3_moe.MoE)):
        return [Phase(f"layer{i}", False, lambda **s: {p + "h": layer(s[h_in], rope)}, (h_in,),
                      list(layer.parameters()))], p + "h"
    moe = layer.mlp

    def attn(**s):
        h = s[h_in]
        h1 = h + layer.self_attn(layer.input_layernorm(h), rope)
        B, S, D = h1.shape
        x_TD = layer.post_attention_layernorm(h1).reshape(B * S, D)
        w_TA, idx_TA, aux = route_tokens(moe, x_TD, sequences=B)
        if aux is not None:
            h1 = AuxLoss.apply(h1, aux)
        return {p + "h1": h1, p + "x": x_TD, p + "w": w_TA, p + "idx": idx_TA}

    def dispatch(**s):
        x_XD, counts_E, *handle = moe.dispatcher.dispatch(s[p + "x"], s[p + "idx"], moe.num_experts)
        return {p + "xd": x_XD, p + "counts": counts_E, p + "handle": tuple(handle)}

    def experts(**s):
        return {p + "yd": moe.experts(s[p + "xd"], s[p + "counts"])}

    def combine(**s):
        T = s[p + "x"].shape[0]
        return {p + "y": moe.dispatcher.combine(s[p + "yd"], s[p + "w"], *s[p + "handle"], T)}

    def moe_call(**s):  # a dispatcher with one call (expert parallel): all-to-all, experts, back
        return {p + "y": moe.dispatcher(s[p + "x"], s[p + "idx"], s[p + "w"], moe.experts)}

    def post(**s):
        h1 = s[p + "h1"]
        return {p + "h": h1 + s[p + "y"].view(h1.shape)}

    gate_params = [*layer.self_attn.parameters(), *layer.input_layernorm.parameters(),
                   *layer.post_attention_layernorm.parameters(), *moe.gate.parameters()]
    attn_phase = Phase(f"attn{i}", False, attn, (h_in,), gate_params)
    post_phase = Phase(f"post{i}", False, post, (p + "h1", p + "y"), [])
    if not hasattr(moe.dispatcher, "dispatch"):
        return [attn_phase, Phase(f"moe{i}", True, moe_call, (p + "x", p + "idx", p + "w"),
                                  list(moe.experts.parameters())), post_phase], p + "h"
    return [attn_phase,
            Phase(f"dispatch{i}", True, dispatch, (p + "x", p + "idx"), []),
            Phase(f"experts{i}", False, experts, (p + "xd", p + "counts"), list(moe.experts.parameters())),
            Phase(f"combine{i}", True, combine, (p + "yd", p + "w", p + "handle", p + "x"), []),
            post_phase], p + "h"


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

    @property
    def output(self):
        return self.state["out"]

    def input_grad(self):
        return self.grads.get("in")


def start(phases, x) -> ChunkRun:
    return ChunkRun(phases, {"in": x})


def forward_phase(run: ChunkRun, k: int):
    ph = run.phases[k]
    leaves = {n: _leaf(run.state[n]) for n in ph.inputs}
    outs = ph.fn(**leaves)
    run.state.update(outs)
    run.records.append((leaves, outs))


def backward_phase(run: ChunkRun, k: int, input_only: bool = False, hold: list | None = None):
    """Backward through phase k (phases are walked from the last). Full: parameter and leaf
    gradients at once. Input-only: leaf gradients, graph retained, output gradients saved for W.
    hold: receives the phase's tensors instead of freeing them (two streams: see forward_backward)."""
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


def weight_backward(run: ChunkRun):
    """W: the parameter gradients of an earlier input-only backward."""
    for k, ts, gs in run.saved:
        params = [p for p in run.phases[k].params if p.requires_grad]
        if params:
            torch.autograd.backward(ts, gs, inputs=params)
    run.saved.clear()
    run.records.clear()


def forward(run: ChunkRun):
    for k in range(len(run.phases)):
        forward_phase(run, k)


def backward(run: ChunkRun, grad_out, input_only: bool = False):
    run.grads["out"] = grad_out.to(run.output.dtype)
    for k in reversed(range(len(run.phases))):
        backward_phase(run, k, input_only)


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


def forward_backward(f: ChunkRun, b: ChunkRun, grad_out, streams: Streams | None = None):
    """Forward all phases of `f` and fully backward all phases of `b`, interleaved: a
    communication phase of one side is paired with a compute phase of the other (greedily; when
    both next phases are of the same kind the backward side goes alone). Returns the pairing as
    [(forward phase name or None, backward phase name or None)] for tests and timelines."""
    b.grads["out"] = grad_out.to(b.output.dtype)
    fi, bi, n_f = 0, len(b.phases) - 1, len(f.phases)
    fc, bc, order = _Chain(), _Chain(), []
    # A tensor made on one stream and last read on the other must not return to the allocator
    # before the reader is done: the backward side's tensors are held until the final barrier.
    hold = [] if streams is not None else None
    while fi < n_f or bi >= 0:
        fph = f.phases[fi] if fi < n_f else None
        bph = b.phases[bi] if bi >= 0 else None
        if fph is not None and bph is not None and fph.comm != bph.comm:
            k_f, k_b = fi, bi
            run_f = lambda: _issue(streams, fph.comm, fc, lambda: forward_phase(f, k_f))  # noqa: E731
            run_b = lambda: _issue(streams, bph.comm, bc, lambda: backward_phase(b, k_b, hold=hold))  # noqa: E731
            # Issue the communication side first so that it starts as early as possible.
            for run in ((run_f, run_b) if fph.comm else (run_b, run_f)):
                run()
            order.append((fph.name, bph.name))
            fi, bi = fi + 1, bi - 1
        elif bph is not None:
            _issue(streams, bph.comm, bc, lambda: backward_phase(b, bi, hold=hold))
            order.append((None, bph.name))
            bi -= 1
        else:
            _issue(streams, fph.comm, fc, lambda: forward_phase(f, fi))
            order.append((fph.name, None))
            fi += 1
    if streams is not None:
        streams.compute.wait_stream(streams.comm)
        streams.comm.wait_stream(streams.compute)
        hold.clear()
    return order
