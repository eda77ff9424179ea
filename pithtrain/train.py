"""Train a Mixture-of-Experts language model from a recipe.

    python -m pithtrain.train                         # embedded default: tiny Qwen3-MoE on stdlib bytes
    python -m pithtrain.train RECIPE.yaml train.lr=1e-3 log.every=5
    invoke train                                      # the same, through tasks.py

One process per GPU (or CPU); several processes come from torchrun (`invoke train --nproc=N`).
train() is start-up (the layout, the checks, process groups, the run lock, the build: build.py,
the checkpoint and the data), the loop, and shutdown, each a function below. The step
(`train_step`, which the benchmark times too): for each micro-batch, forward (summed token loss,
under the run's autocast) and backward with the loss divided by the global number of target
tokens; then clip, AdamW, balancing update, LR schedule. The step owns what it depends on: the
balancing losses' scale, the step's routing statistics, the FP8 weight copies.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import NamedTuple


def stopped_early(*_):
    """Ctrl-C before train() takes SIGINT over: one line (rank 0), exit 130, not a traceback."""
    if os.environ.get("RANK", "0") == "0":
        print("pithtrain: stopped by SIGINT before training began; nothing saved", file=sys.stderr, flush=True)
    raise SystemExit(130)


if __name__ == "__main__":  # while the imports below load (seconds)
    signal.signal(signal.SIGINT, stopped_early)

import torch
import torch.distributed as dist

from pithtrain import kernels, plan
from pithtrain.build import Run, build_run, check_run
from pithtrain.checkpoint.dcp import Checkpointer, CheckpointError, checkpoints_dir, disk_estimate, step_dirs
from pithtrain.compile import compiles
from pithtrain.config import Config, ConfigError, load_config
from pithtrain.data import build_batches, rows
from pithtrain.distributed import pipeline
from pithtrain.distributed.context_parallel import split_batch
from pithtrain.distributed.reductions import all_sum, any_rank, balance_after_step, clip_coef, grad_norm, scale_grads_
from pithtrain.kernels import fp8_linear
from pithtrain.metrics import StartupTimer, StepLog, check_finite, flops_per_token, memory_gb, param_counts, peak_tflops
from pithtrain.models import build_model
from pithtrain.models.balance import reset_step_stats
from pithtrain.models.common import attention_kernels, set_aux_loss_scale
from pithtrain.reliability import HANG_EXIT, Ended, Notice, collective_failure, diagnose, flight_recorder
from pithtrain.rundir import claim

# ---------------------------------------------------------------------------------------------
# Setup


def cuda_allocator() -> str:
    """CUDA's allocator with expandable segments, unless PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF
    is set (yours is kept): a run near its planned peak fragments fixed segments (docs/performance.md).
    Read as CUDA starts: call it before. pick_device and `invoke bench` (the step as train runs it).
    Returns the setting in effect, as the start-up lines print it (KEY=VALUE)."""
    keys = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    if not set(keys) & os.environ.keys():
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return " ".join(f"{k}={os.environ[k]}" for k in keys if k in os.environ)


def pick_device(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{cfg.source}: train.device: 'cuda' requested but no CUDA GPU is visible")
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    cuda_allocator()
    if "LOCAL_RANK" in os.environ:  # torchrun: one GPU per process
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return torch.device("cuda", torch.cuda.current_device())


def startup_lines(cfg: Config, batches) -> list[str]:
    """What the run trains on, what loading resolved, and a warning for a setting that trains on
    the wrong thing or leaves the experts' load to collapse (rank 0 prints them)."""
    m = cfg.model
    lines = [f"pithtrain: data: {batches.about}"] + [f"pithtrain: {n}" for n in cfg.notes]
    if cfg.data.source == "stdlib" and m.vocab_size > 1024:
        lines.append(f"pithtrain: WARNING: data.source is 'stdlib' (byte ids 0-257) but the model has "
                     f"{m.vocab_size} tokens: this run trains on bytes; set data.source=shards")
    knob = {"switch": "aux_loss_coeff", "sequence": "aux_loss_coeff", "bias": "bias_update_rate"}.get(m.balance)
    if m.num_experts > m.top_k and (knob is None or getattr(m, knob) == 0):
        lines.append(f"pithtrain: WARNING: {f'model.{knob} is 0' if knob else 'model.balance is none'}: nothing "
                     "balances the experts' load, so the router may send every token to the same experts "
                     "(`invoke config --keys` lists model.balance and its coefficients)")
    return lines


def collapse_watch(m, n: int = 3):
    """check(routing) -> a warning line, once, when a MoE layer's load max / mean has stayed at its
    maximum (num_experts / top_k: every token on the same top_k experts) for n logged steps."""
    worst, streak, said = m.num_experts / m.top_k, {}, []

    def check(routing: dict) -> str | None:
        for layer, v in routing.get("load_max_mean", {}).items():
            streak[layer] = streak.get(layer, 0) + 1 if worst > 1 and v >= 0.99 * worst else 0
        hit = [k for k, c in streak.items() if c >= n]
        if hit and not said:
            said.append(hit)
            return (f"pithtrain: WARNING: expert load collapsed in layer(s) {', '.join(hit)}: max/mean {worst:g} "
                    f"(every token on the same {m.top_k} of {m.num_experts} experts) for {n} logged steps; "
                    "raise model.aux_loss_coeff or set model.balance=bias")
        return None

    return check


def summary_line(cfg: Config, history: list[dict], batches, global_batch: int, wall_s: float) -> str:
    """The run's last line: steps, tokens seen, passes over the training data (`TokenBatches.epochs`),
    final loss and validation loss, wall time, and the checkpoint to resume (or export) from."""
    t = cfg.train
    seen = t.steps * global_batch * t.seq_len
    loss = f"{history[-1]['loss']:.4f}" if history else "-"
    val = next((f"{r['val_loss']:.4f}" for r in reversed(history) if "val_loss" in r), "-")
    kept = step_dirs(checkpoints_dir(cfg.log.run_dir))
    return (f"pithtrain: done: {t.steps} steps ({len(history)} in this process), {seen / 1e6:.2f}M tokens seen "
            f"({batches.epochs(t.steps):.2f} epochs of {batches.n_train / 1e6:.2f}M), loss {loss}, val_loss {val}, "
            f"{wall_s:.0f} s; checkpoint {kept[0] if kept else 'none (checkpoint.final is false)'}")


def micro_batches(run: Run, batches, x_GS, y_GS) -> list[tuple]:
    """This rank's micro-batches of a global batch (training's and evaluation's): its rows of each
    (data.rows: data-parallel rank of data_parallel_size), on the device, its sequence chunks under
    context parallel, document ids under document masking; (input ids, labels, positions, docs)."""
    t, dims, out = run.cfg.train, run.dims, []
    for micro in range(t.grad_accum):
        r = rows(micro, dims.data_parallel_rank, dims.data_parallel_size, t.micro_batch_size)
        x_BS, y_BS = x_GS[r].to(run.device, non_blocking=True), y_GS[r].to(run.device, non_blocking=True)
        x_BS, y_BS, pos_BS = split_batch(x_BS, y_BS, dims)  # cp: this rank's sequence chunks
        docs_BS = batches.documents(x_BS) if run.cfg.data.document_mask else None  # cp, pp: refused
        out.append((x_BS, y_BS, pos_BS, docs_BS))
    return out


@torch.no_grad()
def evaluate(run: Run, batches, noticed=lambda: False) -> float | None:
    """Mean token loss over train.eval_batches validation batches (the same windows every time),
    each data-parallel rank taking its rows as in training; None when `noticed()` (agreed over
    the ranks before each batch) says a notice came: the step boundary saves and stops."""
    model, was_training = run.model, run.model.training
    model.eval()
    loss_sum = n = 0.0
    with run.precision.weights(model):
        for i in range(run.cfg.train.eval_batches):
            if noticed():
                model.train(was_training)
                return None
            x_GS, y_GS = batches.val_batch(i)
            n += (y_GS != -100).sum().item()
            for x_BS, y_BS, pos_BS, docs_BS in micro_batches(run, batches, x_GS, y_GS):
                with run.precision.autocast():
                    loss_sum += model(x_BS, positions_BS=pos_BS, labels_BS=y_BS, docs_BS=docs_BS).item()
    model.train(was_training)
    return all_sum([loss_sum], run.dims)[0] / n


# ---------------------------------------------------------------------------------------------
# The step


class Step(NamedTuple):
    loss: float  # mean over the global batch's target tokens
    grad_norm: float  # before clipping, over every shard
    lr: float  # the step's learning rate
    tokens: int  # the global batch's tokens, every rank's (tokens/s)
    routing: dict  # routing metrics of the global batch (metrics=True), else {}
    skipped: bool = False  # non-finite under train.on_nonfinite=skip: nothing was updated


def forward_backward(model, micro_batches, denom: float, precision) -> tuple[torch.Tensor, int]:
    """Forward (summed token loss, under the run's autocast) and backward of loss / denom (outside
    it) for each micro-batch (input ids, labels, positions, document ids) on this rank; returns the
    summed loss, on the device (no host synchronisation per micro-batch, but for flash-attn-4's
    document starts under document masking: common.document_starts), and the token count."""
    loss_sum, n_tokens = 0.0, 0
    for x_BS, y_BS, pos_BS, docs_BS in micro_batches:
        with precision.autocast():
            loss = model(x_BS, positions_BS=pos_BS, labels_BS=y_BS, docs_BS=docs_BS)
        (loss / denom).backward()
        loss_sum = loss_sum + loss.detach()
        n_tokens += y_BS.numel()
    return loss_sum, n_tokens


def train_step(run: Run, micro_batches, denom: float, step: int = 0, metrics: bool = False) -> Step:
    """One optimizer step, the same for train() and the benchmark (bench.py): the balancing losses'
    scale (1 / the global batch's micro-batches), the micro-batches' forward and backward (through
    the pipeline schedule on a pipeline rank) on the precision's weights (its bf16 copies, kept
    across steps and rewritten by AdamW, gradients accumulating in float32: precision.py), the
    global loss, the gradient norm over every shard, the finite check (before the update: the
    weights stay finite; train.on_nonfinite=skip drops the step instead, on every rank alike: loss
    and norm are global), the clip and AdamW (one pass where the optimizer takes the clip's factor:
    kernels/adamw.py), the FP8 weight copies dropped, the balancing update, the step's routing
    statistics reset, the LR schedule."""
    model, cfg, dims = run.model, run.cfg, run.dims
    set_aux_loss_scale(model, 1.0 / (len(micro_batches) * dims.data_parallel_size))
    with run.precision.weights(model):
        if run.runner is None:
            loss_sum, n_tokens = forward_backward(model, micro_batches, denom, run.precision)
        else:  # zero off the pipeline's last stage: the sum over ranks is right
            loss_sum, n_tokens = pipeline.run_step(run.runner, micro_batches, denom, cfg, dims, step)
    norm = grad_norm(run.precision.grads(model.parameters()), dims)  # waits for the backward
    loss_sum, n_tokens = all_sum([float(loss_sum), n_tokens], dims)
    loss = loss_sum / denom  # per target (labels -100 carry no loss)
    # skipped: no weight, moment, step count or balancing bias moves, and no routing update
    skipped = cfg.train.on_nonfinite == "skip" and not (math.isfinite(loss) and math.isfinite(norm))
    routing = {"imbalance": math.nan}
    if not skipped:
        check_finite(step + 1, loss=loss, grad_norm=norm)
        coef = clip_coef(norm, cfg.train.grad_clip)
        if getattr(run.optimizer, "takes_grad_scale", False):  # kernels/adamw.py: the clip inside its one pass
            run.optimizer.step(grad_scale=coef)
        else:
            scale_grads_(model.parameters(), coef)
            run.optimizer.step()
        fp8_linear.next_step(model)  # the weights changed: FP8 copies are made again on first use
        routing = balance_after_step(model, dims, cfg.model, metrics=metrics)  # global load: bias, metrics
    reset_step_stats(model)
    run.optimizer.zero_grad(set_to_none=True)
    lr = run.scheduler.get_last_lr()[0]
    run.scheduler.step()  # skipped too: the LR stays a function of the step (the batch is consumed)
    return Step(loss, norm, lr, n_tokens, routing, skipped)


# ---------------------------------------------------------------------------------------------
# Training: start-up, loop, shutdown


@dataclass
class Training:
    """A run being trained: the built run, its checkpoints, data and log, and where it stands."""
    run: Run
    ckpt: Checkpointer
    batches: object
    log: StepLog
    notice: Notice
    begin: int  # steps done before this process (0: fresh)
    started: float  # time.monotonic() at start-up
    global_batch: int
    step: int = 0  # steps done, counting the one running (a collective that timed out names it)
    history: list = field(default_factory=list)

    def boundary(self) -> tuple[int, bool]:
        """Every rank at once: the notice any rank got (its signal number, 0: none), and whether
        checkpoint.every_minutes made a save due by any rank's clock."""
        c = self.run.cfg.checkpoint
        due = bool(c.every_minutes) and time.monotonic() - self.ckpt.saved_at >= 60 * c.every_minutes
        signum, due = any_rank([self.notice.signum, int(due)], self.run.dims, self.ckpt.pg)
        self.notice.signum = self.notice.signum or signum
        return signum, bool(due)


def train(cfg: Config, resume: bool | str = True, draws: str = "cpu") -> tuple[list[dict], torch.nn.Module]:
    """Run optimizer steps up to `cfg.train.steps`; returns the per-step records (loss, lr, grad
    norm, val_loss when evaluated) and the trained model (this rank's part of it).
    resume: True continues from the newest valid checkpoint in log.run_dir, False starts fresh,
    a path continues from that checkpoint (pithtrain/checkpoint/dcp.py). draws: where a fresh
    model's random draws are made (build.build_run; the emulator's "device": minutes less at full depth).
    Whatever fails, what start-up made is released on the way out: the run lock, the process
    groups it made, a save in flight (one process). Raises reliability.Ended after a notice (the
    step just finished saved) or when a collective timed out (each rank's diagnosis written):
    pithtrain/reliability.py."""
    notice, t = Notice(cfg.checkpoint.on_signal), None
    with contextlib.ExitStack() as stack:
        stack.callback(notice.close)
        try:
            t = start(cfg, resume, notice, stack, draws)
            return finish(t, loop(t))
        except RuntimeError as e:
            if not (dist.is_initialized() and collective_failure(e)):
                raise
            line = diagnose(e, cfg.log.run_dir, dist.get_rank(), dist.get_world_size(), t.step if t else 0,
                            cfg.parallel.timeout_s)
            print(line, file=sys.stderr, flush=True)
            raise Ended(HANG_EXIT, line) from None


def start(cfg: Config, resume, notice: Notice, stack: contextlib.ExitStack, draws: str = "cpu") -> Training:
    """Start-up, each thing made registered on `stack` to be released: the layout (parallel: auto;
    on CUDA the memory plan against this GPU), every check (build.check_run), the process groups,
    the run lock (rank 0), the build (build.build_run), the checkpoint to resume, the data."""
    began = time.monotonic()
    device = pick_device(cfg)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    cfg, planned = plan.resolve_launch(cfg, device, world)  # a new Config: the caller's is unchanged
    dims = check_run(cfg, device, world, rank, planned)  # fails before any collective
    if rank == 0 and (line := plan.launch_line(cfg, planned)):
        print(line, flush=True)
    if dims.distributed and device.type == "cuda":
        flight_recorder(cfg.log.run_dir)  # NCCL's last collectives per rank, dumped on a timeout
    dims.init(device, cfg.parallel.timeout_s)  # torchrun's process group and the meshes; nothing for one process
    stack.push(lambda failed, *_: dims.close(failed is not None))
    total, active = param_counts(build_model(cfg.model, init=False), cfg.model)  # meta: whole model
    say = dims.rank == 0
    if say:  # rank 0 locks log.run_dir and checks its storage before anything is built (an error
        stack.callback(claim(cfg, total).close)  # ends rank 0, and torchrun ends the other ranks with it)
    torch.manual_seed(cfg.train.seed)
    with StartupTimer("building the model", say):
        # the plan's answer to precision.keep, or None without a plan (CPU: Precision.of decides)
        run = build_run(cfg, device, dims, draws=draws, keep=None if planned is None else planned["keep"])
        if say:
            print(kernels.describe(run.use, attention_kernels(run.model, run.use)), flush=True)
            print(run.precision.describe(), flush=True)
            if device.type == "cuda":
                print(f"pithtrain: CUDA allocator: {cuda_allocator()}", flush=True)
            if cfg.train.compile and not compiles(cfg.train, device):
                print(f"pithtrain: train.compile=true: off on {device.type}, the layers run eagerly "
                      "(torch.compile acts on CUDA only)", flush=True)
    t = cfg.train
    with StartupTimer("loading the checkpoint and data", say):
        ckpt = Checkpointer(cfg, run.model, run.optimizer, run.scheduler, device, run.precision)
        # on a failure, one process commits a save of an earlier step still in flight (Checkpointer.abort)
        stack.push(lambda failed, *_: ckpt.abort() if failed else None)
        begin = ckpt.resume(resume)  # steps already done = data position (0: fresh); says what it did
        global_batch = t.micro_batch_size * t.grad_accum * dims.data_parallel_size  # cp ranks share rows
        batches = build_batches(cfg.data, t.seq_len, global_batch, t.seed, hold_out=t.eval_every > 0)
    if say:
        print(f"pithtrain: {cfg.model.family} {total / 1e6:.2f}M params ({active / 1e6:.2f}M active) | "
              f"device {device} {str(run.precision.compute).removeprefix('torch.')} | recipe {cfg.source} | "
              f"run dir {cfg.log.run_dir} | {dims.describe()}", flush=True)
        print("\n".join(startup_lines(cfg, batches)), flush=True)
        if disk := disk_estimate(cfg, total):
            print(disk, flush=True)
    log = StepLog(cfg.log.run_dir, begin, enabled=say, total_steps=t.steps, cfg=cfg)
    return Training(run, ckpt, batches, log, notice, begin, began, global_batch, step=begin)


def loop(tr: Training) -> int:
    """Optimizer steps from where the run stands to train.steps, each followed by the step
    boundary (a notice, a timed save: every rank agrees) and the checkpointer. Returns the signal
    number of the notice that stopped it (0: none)."""
    run, cfg = tr.run, tr.run.cfg
    t, dims = cfg.train, run.dims
    tokens_since, collapsed, skips = 0, collapse_watch(cfg.model), [0, 0]  # consecutive, total
    peak = peak_tflops(run.device, cfg.log.peak_tflops)
    tr.log.tick()
    first = StartupTimer("first step" + (" (compiling the layers: can take minutes)"
                                         if compiles(t, run.device) else ""),
                         dims.rank == 0, announce=True)
    stopped = tr.boundary()[0]  # a notice during start-up: nothing more is trained
    for step in range(tr.begin, t.steps) if not stopped else ():
        tr.step = step + 1
        x_GS, y_GS = tr.batches.batch(step)
        denom = (y_GS != -100).sum().item()  # loss = sum over the global batch / its target count
        evaluating = bool(t.eval_every) and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps)
        logged = (step + 1) % cfg.log.every == 0 or step + 1 == t.steps or evaluating  # val_loss logs
        done = train_step(run, micro_batches(run, tr.batches, x_GS, y_GS), denom, step=step, metrics=logged)
        rec = {"step": step + 1, "loss": done.loss, "lr": done.lr, "grad_norm": done.grad_norm}
        first.done()
        if done.skipped:
            skips = [skips[0] + 1, skips[1] + 1]
            logged, rec["skipped_steps"] = True, skips[1]
            why = (f"step {step + 1}: loss {done.loss}, grad_norm {done.grad_norm}: skipped "
                   f"(train.on_nonfinite=skip; {skips[0]} in a row of train.max_skips={t.max_skips})")
            if skips[0] >= t.max_skips:
                kept = step_dirs(checkpoints_dir(cfg.log.run_dir))
                raise FloatingPointError(f"{why}; stopped; the last good checkpoint is "
                                         f"{kept[0] if kept else 'none'}")
            if dims.rank == 0:
                print(f"pithtrain: {why}", flush=True)
        else:
            skips[0] = 0
        if evaluating:
            with tr.log.excluded():  # evaluation time is not training throughput (tokens/s)
                val = evaluate(run, tr.batches, lambda: tr.boundary()[0] > 0)
            if val is not None:
                rec["val_loss"] = val
        tr.history.append(rec)
        tokens_since += done.tokens
        if logged:
            if run.device.type == "cuda":
                torch.cuda.synchronize()
            tps, tokens_since = tokens_since / tr.log.tick(), 0
            mem = memory_gb(run.device)
            extra = {}
            if dims.distributed and mem is not None:  # every rank's peak (pipeline stages differ)
                extra["mem_gb_ranks"] = all_sum([mem if r == dims.rank else 0.0 for r in range(dims.world_size)],
                                                dims)
            # FLOPs of what the logged step computed where the routing decides it (slots dropped)
            fpt = flops_per_token(cfg.model, t.seq_len, done.routing.get("computed_slots_per_token"))
            tr.log.write({**rec, "tokens_per_s": tps,  # all ranks together; MFU is per GPU
                          "mfu": tps * fpt / (peak * 1e12 * dims.world_size) if peak else None,
                          "mem_gb": mem, **done.routing, **extra})
            if dims.rank == 0 and (warning := collapsed(done.routing)):
                print(warning, flush=True)
        stopped, due = tr.boundary()
        tr.ckpt.after_step(step + 1, now=bool(stopped) or due)  # when due (every, every_minutes, final), or a notice
        if stopped:
            break
    return stopped


def finish(tr: Training, stopped: int) -> tuple[list[dict], torch.nn.Module]:
    """Shutdown: the save in flight committed, the export (checkpoint.export_hf), the log closed,
    the run's last line; after a notice, Ended (128 + its signal). The lock and the process groups
    go after it (train's ExitStack)."""
    cfg, say = tr.run.cfg, tr.run.dims.rank == 0
    tr.ckpt.close()  # an asynchronous save still in flight is finished and committed
    if cfg.checkpoint.export_hf and tr.begin < cfg.train.steps and not stopped:
        export_final(cfg)
    tr.log.close()
    if stopped:
        kept = step_dirs(checkpoints_dir(cfg.log.run_dir))
        line = (f"pithtrain: stopped at step {tr.step} by {signal.Signals(stopped).name}; "
                f"{f'saved {kept[0].name}; run again to resume' if kept else 'nothing saved yet; run again to start'}")
        if say:
            print(line, flush=True)
        raise Ended(128 + stopped, line)
    if say:
        print(summary_line(cfg, tr.history, tr.batches, tr.global_batch, time.monotonic() - tr.started), flush=True)
    return tr.history, tr.run.model


def export_final(cfg: Config):
    """checkpoint.export_hf: the final checkpoint, as <run_dir>/hf (every rank writes its shards)."""
    from pathlib import Path

    from pithtrain.checkpoint.export import export
    final = checkpoints_dir(cfg.log.run_dir) / f"step_{cfg.train.steps}"
    export(final, Path(cfg.log.run_dir) / "hf", getattr(torch, cfg.checkpoint.export_dtype))


# ---------------------------------------------------------------------------------------------
# Entry point


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pithtrain.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="?", default=None,
                   help="recipe YAML file or embedded recipe name (default: the tiny embedded default)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.lr=1e-3")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", metavar="PATH", default=None,
                   help="continue from this checkpoint (a step_N dir, or a run dir's newest valid one); "
                        "default: the newest valid checkpoint in log.run_dir, if any")
    g.add_argument("--no-resume", action="store_true", help="start fresh even if log.run_dir has checkpoints")
    p.add_argument("--check", type=int, metavar="WORLD",
                   help="only check the recipe for WORLD processes (invoke train)")
    args = p.parse_intermixed_args(argv)  # flags may sit between overrides
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe:  # only overrides were given
        recipe, overrides = None, [recipe, *overrides]
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(recipe, overrides)
        if args.check:  # parallel: auto's layout (no memory plan off the GPU), then its checks without a device
            cfg, _ = plan.resolve(cfg, args.check)
            check_run(cfg, None, args.check)
            return 0
        train(cfg, resume=False if args.no_resume else (args.resume or True))
    except Ended as e:  # a notice (128 + its signal's number) or a collective timed out: the line is out
        return e.code
    except KeyboardInterrupt:  # before train() took SIGINT over
        stopped_early()
    except (ConfigError, CheckpointError) as e:  # every rank meets the same one: rank 0 says it, and torchrun
        # ends the others while they wait; one still here met its own (a file only it reads)
        time.sleep(5 if rank else 0)
        print(f"error: {f'rank {rank}: ' if rank else ''}{e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # training diverged: the weights and checkpoints stay finite
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # main() and train() take Ctrl-C from here
    sys.exit(main())
