"""Pipeline parallelism: a rank's stages (the pruned model) and the executor that runs its op list
(the schedules themselves, torch-free, are schedule.py).

The executor (`PipelineRunner`) runs one rank's list with torch.distributed point-to-point sends
and receives. Every chunk runs as a list of phases (overlap.py: each layer's own
`DecoderLayer.phases`): the forward records each phase's detached inputs and outputs, B walks the
phases backwards with torch.autograd.grad w.r.t. the phase inputs only (retain_graph), W then
calls torch.autograd.backward w.r.t. the phase's parameters with the output gradients B saved.
That is the split of backward into input- and weight-gradient the schedules assume; it
re-traverses each phase's graph once more in W (DualPipe's WeightGradStore avoids that by
deferring only the weight matmuls: a later optimisation that changes no schedule). Under FSDP the
chunk drives each layer's all-gather and reduce-scatter (the latter in W; overlap.py). An FB op
interleaves its two micro-batches' phases when `parallel.pp_overlap` is on, else runs F then BW.
Loss scaling: the last stage backpropagates loss_sum / (target tokens of the global batch),
gradients accumulate over micro-batches in `.grad`, and the MoE auxiliary loss is scaled by 1 / M
(the train step sets it: `common.set_aux_loss_scale`), so the gradients equal a single process
running the same micro-batches (tests/test_pipeline.py, tests/test_pipeline_overlap.py). Precision
is the run's (precision.Precision): forward phases under its autocast, backward outside it, as
train.py's step; activations travel between stages in its compute dtype.

Communication: sends are asynchronous (isend, waited at the end of the step), receives block
right before the op that needs them, so a schedule that `simulate` can finish cannot deadlock.
Activations travel on one process group and gradients on a second one over the same ranks, so
that between two ranks each (group, direction) carries one stream of micro-batches in order:
NCCL matches point-to-point messages by order, gloo also by tag (set explicitly here). The last
step's op and phase timeline is written for `python -m pithtrain.pipeline_viz` (run_step); it is
timed as every step runs (CUDA events, resolved once at the end: no synchronisation per op).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from pithtrain.distributed import overlap
from pithtrain.distributed.schedule import Chunk, Op, build_schedule, rank_chunks, stage_rank

# ---------------------------------------------------------------------------------------------
# Stages


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
        model.norm = model.lm_head = None
    return attach_ends(model)


def attach_ends(model: torch.nn.Module) -> torch.nn.Module:
    """The pipeline never calls the model's forward; it calls the layers' phases and the ends
    (overlap.chunk_phases), driving FSDP's gathers itself. `pipeline_begin` (called at each step
    start), hooked by FSDP (`register_fsdp_methods`), lets the root FSDP unit initialise first."""
    model.pipeline_begin = lambda: None
    return model


def register_fsdp_methods(model: torch.nn.Module):
    """After `parallelize`: FSDP's root hooks around `pipeline_begin` (torch's call does nothing
    to a model without FSDP)."""
    register_fsdp_forward_method(model, "pipeline_begin")


# ---------------------------------------------------------------------------------------------
# Executor


def new_pp_groups(pp_rank_lists: list[list[int]]):
    """Two process groups over each pipeline's ranks (global ranks, one list per pipeline):
    activations travel on the first, gradients on the second. Every rank must call this with the
    same lists (torch.distributed creates groups collectively). Returns this rank's pair."""
    return tuple(dist.new_subgroups_by_enumeration(pp_rank_lists)[0] for _ in range(2))


class PipelineRunner:
    """Runs one rank's op list for one optimizer step (module docstring, part 3).

    model: this rank's pruned model (`prune_model`); chunks: its `rank_chunks`; act_shape: the
    (micro-batch, sequence, hidden) shape of the activations between stages, which travel in the
    residual stream's dtype, the run's compute dtype (`precision`: bf16 weights there, FSDP's
    gathers or the precision's bf16 copies; float32 without one). `timeline`, when a list,
    receives {"op", "start", "end"} per compute op (seconds from the step start; on CUDA from
    events around each op, resolved after the step: the op's device time, no synchronisation)."""

    def __init__(self, model, chunks: list[Chunk], ops: list[Op], pp_rank: int, pp: int, schedule: str,
                 num_micro: int, group_f, group_b, act_shape, device, streams=None, precision=None,
                 checkpointed: bool = False, overlap: bool = True):
        self.model, self.chunks, self.ops = model, chunks, ops
        self.pp_rank, self.pp, self.schedule, self.M = pp_rank, pp, schedule, num_micro
        self.group_f, self.group_b = group_f, group_b
        self.act_shape, self.device, self.streams = tuple(act_shape), device, streams
        self.autocast = precision.autocast if precision is not None else contextlib.nullcontext
        self.act_dtype = precision.compute if precision is not None else torch.float32
        self.cuda = device.type == "cuda"
        self.overlap = overlap  # FB ops: interleave the pair's phases (else: F, then BW)
        self.holds_loss = any(c.last for c in chunks)
        self.timeline = None
        # Layers run as their phases (overlap.py), and under FSDP the runner drives each layer's
        # gather / reduce-scatter itself, so B defers the weight gradient and its reduce-scatter
        # to W. Activation checkpointing wraps a layer's own call, so checkpointed layers run
        # whole; under FSDP their hooks then reduce in B, so B is a full backward there.
        self.fsdp = isinstance(model, FSDPModule)
        self.split_layers = not checkpointed
        self.split = not (self.fsdp and checkpointed)

    # --- helpers
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
        with self.autocast():  # the rope tables, as the one-process forward makes them
            phases = overlap.chunk_phases(self.model, chunk, positions_BS, y_BS if chunk.last else None,
                                          split_layers=self.split_layers)
        run = overlap.start(phases, x, fsdp=self.fsdp, mb=mb, chunk=c, timeline=self.phase_log,
                            autocast=self.autocast)
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
        g = run.grads.get("in")
        if not self.chunks[c].first:
            if self._local_prev(c):
                self.local_grad[(c - 1, mb)] = g
            else:
                self.b_out[(c, mb)] = g
        run.grads.clear()
        if full:
            del self.runs[(c, mb)]

    # --- one step
    def step(self, micro_batches, denom: float) -> torch.Tensor:
        """micro_batches: M (input ids, labels[, positions[, document ids: refused with pp]]) on
        the device (every rank gets them; the first stage reads the ids, the last the labels).
        Returns this rank's summed token loss (non-zero only where the last stage lives: a sum over
        ranks gives the total)."""
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
        self.phase_log = [] if self.timeline is not None else None
        origin = overlap.mark(self.cuda) if self.timeline is not None else None
        for op in self.ops:
            k, c, mb = op.kind, op.chunk, op.mb
            if k in ("RECV_F", "RECV_B"):
                buf = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
                group = self.group_f if k == "RECV_F" else self.group_b
                dist.irecv(buf, src=dist.get_global_rank(group, op.peer), group=group,
                           tag=self._tag(self.chunks[c].stage, mb)).wait()
                (self.f_in if k == "RECV_F" else self.b_in)[(c, mb)] = buf.requires_grad_(k == "RECV_F")
                continue
            if k in ("SEND_F", "SEND_B"):
                if k == "SEND_F":
                    t, group, dest = self.runs[(c, mb)].output.detach(), self.group_f, self.chunks[c].stage + 1
                else:
                    t, group, dest = self.b_out.pop((c, mb)), self.group_b, self.chunks[c].stage - 1
                t = t.to(self.act_dtype).contiguous()
                pending.append((dist.isend(t, dst=dist.get_global_rank(group, op.peer), group=group,
                                           tag=self._tag(dest, mb)), t))
                continue
            start, n_logged = overlap.mark(self.cuda) if self.timeline is not None else None, len(self.phase_log or ())
            self._compute(op)  # forward phases under the run's autocast (overlap.forward_phase)
            if self.timeline is not None:
                self.timeline.append({"op": str(op), "kind": k, "start": start, "end": overlap.mark(self.cuda)})
                for e in self.phase_log[n_logged:]:
                    e["op"] = str(op)
        for work, _ in pending:
            work.wait()
        if self.fsdp:
            overlap.finish_fsdp(self.model)
        if self.timeline is not None:
            if self.cuda:  # once, after the step: the events are complete
                torch.cuda.synchronize(self.device)
            overlap.resolve_timeline(self.timeline + self.phase_log, t0, origin)
            self.phases_timeline = self.phase_log
        assert not self.runs and not self.f_in and not self.b_in and not self.b_out, "schedule left work"
        return self.loss_sum

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
            if self.overlap:
                overlap.forward_backward(f, self.runs[(op.b_chunk, op.b_mb)], g, self.streams)
            else:
                overlap.forward(f)
                overlap.backward(self.runs[(op.b_chunk, op.b_mb)], g)
            self._after_forward(c, mb)
            self._after_backward(op.b_chunk, op.b_mb, full=True)
        else:
            raise ValueError(f"unknown op {op}")


# ---------------------------------------------------------------------------------------------
# The trainer's three calls (train.py): prepare before parallelize, runner after materialise


def prepare(model, cfg, dims) -> list[Chunk]:
    """Prune the (meta) model to this rank's chunks (the settings were checked with the layout:
    ParallelDims.validate)."""
    p = cfg.parallel
    chunks = rank_chunks(dims.pp_rank, p.pp, p.pp_schedule, cfg.model.num_layers, p.pp_layers)
    prune_model(model, chunks)
    return chunks


def make_runner(model, chunks, cfg, dims, device, precision) -> "PipelineRunner":
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
                          device, streams, precision, checkpointed=t.activation_checkpoint != "none",
                          overlap=p.pp_overlap)


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
    return loss, (sum(mb[1].numel() for mb in micro_batches) if runner.holds_loss else 0)


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

