"""One rank of an N-GPU layout, measured on the one GPU at hand: what a user runs before renting eight.

    python -m pithtrain.emulate gpt-oss-20b --gpus 8 --gpu h100 --set parallel.fsdp=8 --set parallel.ep=8
    invoke emulate --model deepseek-v2-lite --gpus 8 --gpu h100 --set parallel.pp=1   # auto's pick without a pipeline

Rank 0's exact program of the layout a launch of N processes on `--gpu` would run (plan.resolve
with that GPU's name and memory, `parallel: auto` included; where this machine has a GPU, the
target's recipe overrides), at full depth: train.train() itself, in this one process, under a
process group of N ranks whose collectives are stand-ins (StandIn, below) that act as if every
rank were this one. Memory is capped at the target GPU's, less this device's CUDA context (which
the target holds too: torch.cuda.set_per_process_memory_fraction), and a layout whose memory plan
does not fit is refused as a launch refuses it. Checkpoints,
evaluation and the export are off, the run directory is a temporary one, and the initial weights
are drawn on the device (minutes less than a launch's CPU draws at full depth: other values, the
same shapes). Printed side by side: the measured step (the median of the steps after --warmup,
which compile; from the step log), the measured peak memory (torch.cuda.max_memory_allocated),
the memory plan's peak for rank 0, and perf.predict of the layout on the GPU at hand, with ratios.
The emulated step is the prediction's compute and optimizer parts; its communication parts (the
exposed FSDP gathers, the all-to-all) are the model's alone, since a stand-in copies locally what
a collective sends (those copies are measured). A pipeline (pp > 1) is refused: one rank cannot
play another stage. On CPU (tiny recipes: how CI tests it) there is no cap and no GPU override.

The stand-ins, as if each rank of the group held this rank's data:
    all-gather      into one tensor (FSDP's, context parallel's): slot j is the local shard with
                    its elements' signs flipped by slot j's fixed pseudo-random pattern (its own
                    slot as is): the right shapes and magnitudes, values that differ (a router
                    gathered from shards has no ties, its experts' logits are uncorrelated), and
                    no value moved across the parameters of FSDP's flat buffer (a roll would put
                    a norm's ones into a weight); into a list (all_gather_object's): copies
    reduce-scatter  this rank's chunk, times the group size for SUM (PREMUL_SUM: and its factor)
    all-reduce      SUM: times the group size; MAX, MIN, AVG: unchanged
    all-to-all      output slot j: the input chunk this rank sends itself (the mirror: under
                    balanced routing, the balanced expert traffic), repeated or cut where the
                    sizes differ (the backward's reverse exchange)
    barrier, broadcast: nothing to wait for or learn
Every group made under it is one (`standin_world`), the checkpointer's gloo groups too. Every rank
sees this rank's batch: the gradient norm is that of one rank's batch (larger than a launch's,
whose ranks' batches average their noise); the loss falls as a launch's does.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.distributed import ReduceOp
from torch.futures import Future

from pithtrain import perf, plan
from pithtrain.config import ConfigError, load_config
from pithtrain.gpus import GPUS, gpu_key

# ---------------------------------------------------------------------------------------------
# The stand-in process group

SIGN_PERIOD = 4093  # a prime: no alignment with the power-of-two widths of a weight's rows


def _done(result=None):
    f = Future()
    f.set_result(result)
    return _create_work_from_future(f)


def _signed(out: torch.Tensor, x: torch.Tensor, signs_P: torch.Tensor):
    """out = x times signs_P repeated along x's flattened elements: elementwise, so no value moves
    across the boundary of two parameters in FSDP's flat buffer."""
    o, x = out.view(-1), x.reshape(-1)
    P = len(signs_P)
    m = len(x) // P * P
    torch.mul(x[:m].view(-1, P), signs_P, out=o[:m].view(-1, P))
    torch.mul(x[m:], signs_P[:len(x) - m], out=o[m:])


def _repeated(out: torch.Tensor, x: torch.Tensor):
    """out's rows: x's rows over and over, cut at out's length; zeros where x has none."""
    if len(x) == 0:
        out.zero_()
        return
    for k in range(0, len(out), len(x)):
        out[k:k + len(x)].copy_(x[:len(out) - k])


class StandIn(dist.ProcessGroup):
    """A process group of `size` ranks whose collectives act as if every rank were this one (the
    module docstring): those train() calls, each done when it returns (a completed Work), its copies
    on the caller's stream. Both spellings of the tensor collectives: torch 2.12+ calls
    all_gather_single, reduce_scatter_single, all_to_all_single; 2.11 (the Hopper image)
    _allgather_base, _reduce_scatter_base, alltoall_base. Another collective: the base class's error."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        # slot j's signs: a fixed pseudo-random pattern of a prime period (per device and dtype)
        g = torch.Generator().manual_seed(size)
        self._signs = torch.randint(0, 2, (size, SIGN_PERIOD), generator=g).float() * 2 - 1
        self._on = {}

    def size(self):
        return self._size

    def getBackendName(self):
        return "standin"

    @property
    def group_name(self):
        return dist.distributed_c10d._world.pg_names[self]

    def _reduce(self, t: torch.Tensor, op):
        """t as the reduction of `size` copies of it."""
        kind = getattr(op, "op", op)
        if kind == ReduceOp.SUM:
            t.mul_(self._size)
        elif kind == ReduceOp.PREMUL_SUM:  # FSDP's, with parallelize.py's divide factor 1
            t.mul_(self._size * getattr(op, "factor", 1.0))
        elif kind not in (ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG):
            raise NotImplementedError(f"stand-in process group: reduce op {kind}")

    def allgather(self, output_tensors, input_tensors, opts=None):
        for outs, x in zip(output_tensors, input_tensors):
            for o in outs:
                o.copy_(x)
        return _done(output_tensors)

    def all_gather_single(self, output, input, opts=None):
        for j, o in enumerate(output.chunk(self._size)):
            if j == self._rank or not input.is_floating_point():
                o.view(-1).copy_(input.reshape(-1))
                continue
            key = (input.device, input.dtype)
            if key not in self._on:
                self._on[key] = self._signs.to(input.device, input.dtype)
            _signed(o, input, self._on[key][j])
        return _done(output)

    def reduce_scatter_single(self, output, input, opts=None):
        output.copy_(input.chunk(self._size)[self._rank].view_as(output))
        self._reduce(output, opts.reduceOp)
        return _done(output)

    def allreduce(self, tensors, opts=None):
        for t in tensors:
            self._reduce(t, opts.reduceOp)
        return _done(tensors)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        ins = input.split(input_split_sizes) if input_split_sizes else input.chunk(self._size)
        outs = output.split(output_split_sizes) if output_split_sizes else output.chunk(self._size)
        for o in outs:
            _repeated(o, ins[self._rank])
        return _done(output)

    def barrier(self, opts=None):
        return _done()

    def broadcast(self, tensors, opts=None):
        return _done(tensors)

    _allgather_base, _reduce_scatter_base, alltoall_base = all_gather_single, reduce_scatter_single, all_to_all_single


dist.Backend.register_backend("standin", lambda store, rank, size, timeout: StandIn(rank, size),
                              devices=["cpu", "cuda"])


@contextlib.contextmanager
def standin_world(world_size: int, rank: int = 0):
    """This process as `rank` of a stand-in world of `world_size` ranks: the default group and
    every group made in it (DeviceMesh's, the checkpointer's `new_group(backend="gloo")`, which
    would wait for N processes) are StandIn; RANK and WORLD_SIZE say so to train.py."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the emulator makes its own process group; this process already has one")
    new_group, env = dist.new_group, {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}

    def standin_group(*args, **kwargs):
        return new_group(*args, **{**kwargs, "backend": "standin"})

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("standin", store=FakeStore(), rank=rank, world_size=world_size)
    dist.new_group = standin_group
    try:
        yield dist.distributed_c10d._get_default_group()
    finally:
        dist.new_group = new_group
        dist.destroy_process_group()
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------------------------------------
# The emulated rank


def prepare(recipe, world: int, gpu: str, steps: int, overrides=(), gpu_overrides: bool = True,
            run_dir: str = "") -> tuple:
    """(the Config to run, the memory plan of its rank 0): `recipe` with `gpu`'s overrides (where
    `gpu_overrides`) and the caller's, resolved as a launch of `world` processes on `gpu` resolves
    it (plan.resolve: its name, its memory; the recipe as written, evaluation included), then
    `steps` steps into `run_dir` with what the emulated run leaves out turned off: evaluation,
    checkpoints, the export, TensorBoard and W&B (a step logged each step), `parallel.auto` (the
    sizes are chosen: train() keeps them). ConfigError where the layout is invalid or has pp > 1."""
    cfg = load_config(recipe, [*(GPUS[gpu].overrides if gpu_overrides else ()), *overrides])
    cfg, planned = plan.resolve(cfg, world, gpu, GPUS[gpu].memory_gib)
    if cfg.parallel.pp > 1:
        raise ConfigError(f"{cfg.source}: parallel.pp={cfg.parallel.pp}: one emulated rank cannot play another "
                          "pipeline stage; emulate a layout without one (--set parallel.pp=1)")
    r = dataclasses.replace
    return r(cfg, train=r(cfg.train, steps=steps, eval_every=0), parallel=r(cfg.parallel, auto=False),
             checkpoint=r(cfg.checkpoint, every=0, every_minutes=0.0, final=False, export_hf=False,
                          weights_only=False),
             log=r(cfg.log, every=1, tensorboard=False, wandb=None, run_dir=run_dir or cfg.log.run_dir)), planned


def emulate(recipe, world: int, gpu: str, steps: int = 5, overrides=(), warmup: int = 2) -> dict:
    """Rank 0 of `recipe` on `world` x `gpu` run here (the module docstring): the measurements, the
    plan and the model's prediction as one dict (`table` prints it); the step is the median of the
    steps after the first `warmup` (< steps: compilation, and the recompilation a second shape
    makes). ConfigError: a layout that cannot be emulated, or on CUDA one whose plan does not fit
    `gpu` (as a launch refuses it)."""
    from pithtrain.train import pick_device, train

    run_dir = tempfile.mkdtemp(prefix="pithtrain-emulate-")
    try:  # the target's overrides where this machine has a GPU
        cfg, planned = prepare(recipe, world, gpu, steps, overrides, torch.cuda.is_available(), run_dir)
        device = pick_device(cfg)
        print(f"{plan.launch_line(cfg, planned)}; emulating its rank 0 on {device}", flush=True)
        cap = None
        if device.type == "cuda":
            if not planned["fits"]:
                raise ConfigError(planned["refusal"])
            free, total = torch.cuda.mem_get_info(device)  # the CUDA context lies outside the allocator,
            cap = GPUS[gpu].memory_gib * plan.GIB - (total - free - torch.cuda.memory_reserved(device))  # as there
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
            torch.cuda.reset_peak_memory_stats(device)
        try:
            with standin_world(world):
                history, _ = train(cfg, resume=False, draws="device")
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        finally:
            if device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0, device)
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    t, lay = cfg.train, plan.layout_of(vars(cfg.parallel))
    tokens = t.micro_batch_size * t.seq_len * t.grad_accum * lay["dp"] * lay["fsdp"]  # every rank's
    secs = [tokens / r["tokens_per_s"] for r in records]  # log.every=1: each step's wall time
    here = gpu_key(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    known = cfg.model.family in perf.load_costs()["families"]
    return {"recipe": cfg.source, "world_size": world, "gpu": gpu, "device": str(device), "gpu_here": here,
            "layout": {k: lay[k] for k in ("pp", "dp", "fsdp", "cp", "ep")},
            "cap_gib": cap and cap / plan.GIB,
            "step_s": secs, "warmup": warmup, "step_s_median": statistics.median(secs[warmup:]), "peak_bytes": peak,
            "plan_peak_bytes": planned["ranks"][0]["peak"], "losses": [r["loss"] for r in history],
            "prediction_here": perf.predict(cfg, lay, here) if known and here else None,
            "prediction_target": perf.predict(cfg, lay, gpu) if known else None}


def table(r: dict) -> str:
    """Measured against the memory plan and the model, side by side, with ratios."""
    lay = " ".join(f"{k}={v}" for k, v in r["layout"].items())
    cap = f"memory capped at {r['cap_gib']:.1f} GiB" if r["cap_gib"] else "no memory cap (CPU)"
    here = f" ({r['gpu_here']})" if r["gpu_here"] else ""
    pred, n = r["prediction_here"], len(r["step_s"])
    parts = pred["parts_s"] if pred else {}
    lines = [f"emulated: rank 0 of {lay} on {r['world_size']} x {r['gpu']}, measured on {r['device']}{here}, {cap}",
             f"{'':<38}{'measured':>10}{'model':>10}{'ratio':>8}"]

    def row(name, got, want, fmt, note):
        show = [("-" if v is None else format(v, fmt)) for v in (got, want)]
        ratio = f"{got / want:.2f}" if got is not None and want else "-"
        lines.append(f"{name:<38}{show[0]:>10}{show[1]:>10}{ratio:>8}   {note}")

    row(f"step (s), median of steps {r['warmup'] + 1}-{n}", r["step_s_median"],
        parts["compute"] + parts["optimizer"] if pred else None, ".3f",
        f"model: compute {parts['compute']:.3f} + optimizer {parts['optimizer']:.3f} on {pred['gpu']}" if pred
        else "model: none on this device")
    row("peak memory (GiB), rank 0", None if r["peak_bytes"] is None else r["peak_bytes"] / plan.GIB,
        r["plan_peak_bytes"] / plan.GIB, ".2f", f"model: the memory plan on {r['world_size']} x {r['gpu']}")
    if pred:
        lines.append(f"not emulated (stand-ins copy what these send), the model's on {pred['gpu']}: FSDP exposed "
                     f"{parts['fsdp_cp_exposed']:.3f} s, all-to-all {parts['all_to_all']:.3f} s")
    if tgt := r["prediction_target"]:
        lines.append(f"the model's step on {r['world_size']} x {tgt['gpu']}: {tgt['step_s']:.3f} s, "
                     f"{tgt['tokens_per_s_per_gpu'] / 1e3:.1f}K tokens/s per GPU")
    lines.append("steps (s): " + " ".join(f"{s:.3f}" for s in r["step_s"])
                 + " | loss: " + " ".join(f"{x:.4f}" for x in r["losses"]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Entry point


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pithtrain.emulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="?", default=None, help="recipe file or embedded name (default: the tiny default)")
    p.add_argument("--gpus", type=int, default=8, help="the world size to emulate (default 8: one node)")
    p.add_argument("--gpu", choices=sorted(GPUS), default=None,
                   help="the target GPU (its memory caps the run; default: the GPU at hand, else h100)")
    p.add_argument("--steps", type=int, default=5, help="steps to run (default 5)")
    p.add_argument("--warmup", type=int, default=2,
                   help="steps left out of the median (default 2: the first compiles, the second may recompile)")
    p.add_argument("--set", action="append", default=[], help="section.key=value (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.gpus < 2:
        p.error("--gpus: emulate a world of 2 or more (one GPU is `invoke train` itself)")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup {args.warmup}: must be at least 0 and below --steps ({args.steps})")
    gpu = args.gpu or (gpu_key(torch.cuda.get_device_name()) if torch.cuda.is_available() else None) or "h100"
    try:
        result = emulate(args.recipe, args.gpus, gpu, args.steps, tuple(args.set), args.warmup)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError as e:  # the plan fitted; the run did not
        print(f"error: rank 0 ran out of memory under {gpu}'s {GPUS[gpu].memory_gib} GiB: "
              f"{str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
