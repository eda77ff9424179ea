"""Train a Mixture-of-Experts language model from a recipe.

    python -m pithtrain.train                         # embedded default: tiny Qwen3-MoE on stdlib bytes
    python -m pithtrain.train RECIPE.yaml train.lr=1e-3 log.every=5
    invoke train                                      # the same, through tasks.py

One process per GPU (or CPU); several processes come from torchrun (`invoke train --nproc=N`).
The step (`train_step`, which the benchmark times too): for each micro-batch, forward (summed
token loss) and backward with the loss divided by the global number of target tokens; then clip,
AdamW, balancing update, LR schedule; train() logs, evaluates and checkpoints around it.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time
from typing import NamedTuple


def stopped_early(*_):
    """Ctrl-C before train() takes SIGINT over: one line (rank 0), exit 130, not a traceback."""
    if os.environ.get("RANK", "0") == "0":
        print("pithtrain: stopped by SIGINT before training began; nothing saved", file=sys.stderr, flush=True)
    raise SystemExit(130)


if __name__ == "__main__":  # while the imports below load (seconds)
    signal.signal(signal.SIGINT, stopped_early)

import torch
from safetensors import SafetensorError

from pithtrain import kernels
from pithtrain.checkpoint.dcp import CheckpointError, Checkpointer, checkpoints_dir, disk_estimate, step_dirs
from pithtrain.checkpoint.hf import load_hf_into
from pithtrain.config import Config, ConfigError, load_config
from pithtrain.data import build_batches, rows
from pithtrain.distributed.context_parallel import split_batch
from pithtrain.distributed.parallel_dims import ParallelDims
from pithtrain.distributed import pipeline
from pithtrain.distributed.parallelize import bf16_weights, materialize, parallelize, uses_bf16_weights
from pithtrain.distributed.reductions import (all_sum, any_rank, balance_after_step, clip_coef, drop_step_stats,
                                              grad_norm, scale_grads_)
from pithtrain.kernels import fp8_linear
from pithtrain.metrics import (StepLog, check_finite, flops_per_token, memory_gb, param_counts,
                               peak_tflops, phase)
from pithtrain.models import build_model
from pithtrain.models.common import set_aux_loss_scale, use_kernels
from pithtrain.plan import check_launch
from pithtrain.reliability import HANG_EXIT, Ended, Notice, collective_failure, diagnose, flight_recorder
from pithtrain.rundir import claim


# ---------------------------------------------------------------------------------------------
# Setup


def pick_device(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{cfg.source}: train.device: 'cuda' requested but no CUDA GPU is visible")
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if "LOCAL_RANK" in os.environ:  # torchrun: one GPU per process
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return torch.device("cuda", torch.cuda.current_device())


def compute_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    if cfg.train.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.train.dtype)


def check_runnable(cfg: Config, device: torch.device):
    """Refuse settings this machine cannot honour, before anything is built."""
    if not cfg.train.fp8:
        return
    if device.type != "cuda":
        raise ConfigError(f"{cfg.source}: train.fp8: FP8 training needs a Hopper or Blackwell GPU; "
                          "this run is on CPU (set train.fp8=false)")
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise ConfigError(f"{cfg.source}: train.fp8: FP8 GEMMs need FP8 tensor cores (compute capability 8.9+); "
                          f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]} (set train.fp8=false)")
    if not kernels.HAVE_TRITON or cfg.train.kernels != "auto":
        raise ConfigError(f"{cfg.source}: train.fp8: the FP8 GEMMs are Triton kernels; they need triton "
                          "installed and train.kernels=auto")


def build_optimizer(model: torch.nn.Module, cfg: Config, device: torch.device, use: dict | None = None):
    """AdamW with fp32 master weights; no weight decay on norms, biases and 1-D tensors. `use`
    (kernels.configure): adamw -> the Triton step (kernels/adamw.py), else torch's, fused on CUDA."""
    decay, no_decay = [], []
    for p in {id(p): p for p in model.parameters() if p.requires_grad}.values():
        (decay if p.ndim >= 2 else no_decay).append(p)
    t = cfg.train
    groups = [{"params": decay, "weight_decay": t.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if use and use["adamw"]:
        from pithtrain.kernels.adamw import AdamW

        return AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
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


@torch.no_grad()
def evaluate(model, batches, cfg: Config, dims: ParallelDims, device, autocast, noticed=lambda: False) -> float | None:
    """Mean token loss over train.eval_batches validation batches (the same windows every time),
    each data-parallel rank taking its rows as in training; None when `noticed()` (agreed over
    the ranks before each batch) says a notice came: the step boundary saves and stops."""
    t = cfg.train
    was_training = model.training
    model.eval()
    loss_sum = n = 0.0
    with bf16_weights(model, uses_bf16_weights(dims, autocast)):
        for i in range(t.eval_batches):
            if noticed():
                model.train(was_training)
                return None
            x_GS, y_GS = batches.val_batch(i)
            n += (y_GS != -100).sum().item()
            for micro in range(t.grad_accum):
                r = rows(micro, dims.batch_rank, dims.batch_size, t.micro_batch_size)
                x_BS, y_BS, pos_BS = split_batch(x_GS[r].to(device), y_GS[r].to(device), dims)
                docs_BS = batches.documents(x_BS) if cfg.data.document_mask else None
                with autocast:
                    loss_sum += model(x_BS, positions_BS=pos_BS, labels_BS=y_BS, docs_BS=docs_BS).item()
    model.train(was_training)
    return all_sum([loss_sum], dims)[0] / n


# ---------------------------------------------------------------------------------------------
# Training


class Step(NamedTuple):
    loss: float  # mean over the global batch's target tokens
    grad_norm: float  # before clipping, over every shard
    lr: float  # the step's learning rate
    tokens: int  # the global batch's tokens, every rank's (tokens/s)
    routing: dict  # routing metrics of the global batch (metrics=True), else {}
    skipped: bool = False  # non-finite under train.on_nonfinite=skip: nothing was updated


def forward_backward(model, micro_batches, denom: float, autocast) -> tuple[torch.Tensor, int]:
    """Forward (summed token loss) and backward of loss / denom for each micro-batch (input ids,
    labels, positions, document ids) on this rank; returns the summed loss, on the device (no
    host synchronisation per micro-batch, but for flash-attn-4's document starts under document
    masking: common.document_starts), and the token count."""
    loss_sum, n_tokens = 0.0, 0
    for x_BS, y_BS, pos_BS, docs_BS in micro_batches:
        with autocast:
            loss = model(x_BS, positions_BS=pos_BS, labels_BS=y_BS, docs_BS=docs_BS)
        (loss / denom).backward()
        loss_sum = loss_sum + loss.detach()
        n_tokens += y_BS.numel()
    return loss_sum, n_tokens


def train_step(model, optimizer, scheduler, micro_batches, denom: float, cfg: Config, dims: ParallelDims,
               autocast, runner=None, step: int = 0, metrics: bool = False) -> Step:
    """One optimizer step, the same for train() and the benchmark (bench.py): the micro-batches'
    forward and backward (through the pipeline schedule when `runner` is given), the global loss,
    the gradient norm over every shard, the finite check (before the update: the weights stay
    finite; train.on_nonfinite=skip drops the step instead, on every rank alike: loss and norm are
    global), the clip and AdamW (one pass where the optimizer takes the clip's factor: kernels/adamw.py),
    the FP8 weight copies dropped, the balancing update, the LR schedule.
    Under bf16 autocast without FSDP the micro-batches run on one bf16 copy of the weights (kept
    across steps, rewritten by AdamW), gradients accumulating in float32 (parallelize.bf16_weights)."""
    with bf16_weights(model, uses_bf16_weights(dims, autocast)):
        if runner is None:
            loss_sum, n_tokens = forward_backward(model, micro_batches, denom, autocast)
        else:  # zero off the pipeline's last stage: the sum over ranks is right
            loss_sum, n_tokens = pipeline.run_step(runner, micro_batches, denom, cfg, dims, step)
    norm = grad_norm(model.parameters(), dims)  # waits for the backward
    loss_sum, n_tokens = all_sum([float(loss_sum), n_tokens], dims)
    loss = loss_sum / denom  # per target (labels -100 carry no loss)
    if cfg.train.on_nonfinite == "skip" and not (math.isfinite(loss) and math.isfinite(norm)):
        optimizer.zero_grad(set_to_none=True)  # no weight, moment or step count moves
        drop_step_stats(model)  # nor the balancing bias
        lr = scheduler.get_last_lr()[0]
        scheduler.step()  # the LR stays a function of the step (the batch is consumed)
        return Step(loss, norm, lr, n_tokens, {"imbalance": math.nan}, skipped=True)  # no routing update
    check_finite(step + 1, loss=loss, grad_norm=norm)
    coef = clip_coef(norm, cfg.train.grad_clip)
    if getattr(optimizer, "takes_grad_scale", False):  # kernels/adamw.py: the clip inside its one pass
        optimizer.step(grad_scale=coef)
    else:
        scale_grads_(model.parameters(), coef)
        optimizer.step()
    fp8_linear.next_step(model)  # the weights changed: FP8 copies are made again on first use
    routing = balance_after_step(model, dims, cfg.model, metrics=metrics)  # global load: bias, metrics
    optimizer.zero_grad(set_to_none=True)
    lr = scheduler.get_last_lr()[0]
    scheduler.step()
    return Step(loss, norm, lr, n_tokens, routing)


def train(cfg: Config, resume: bool | str = True) -> tuple[list[dict], torch.nn.Module]:
    """Run optimizer steps up to `cfg.train.steps`; returns the per-step records (loss, lr, grad
    norm, val_loss when evaluated) and the trained model (this rank's part of it).
    resume: True continues from the newest valid checkpoint in log.run_dir, False starts fresh,
    a path continues from that checkpoint (pithtrain/checkpoint/dcp.py).
    Raises reliability.Ended after a notice (the step just finished saved) or when a collective
    timed out (each rank's diagnosis written): pithtrain/reliability.py."""
    notice, at = Notice(cfg.checkpoint.on_signal), {"step": 0}
    try:
        return _train(cfg, resume, notice, at)
    except RuntimeError as e:
        if not (torch.distributed.is_initialized() and collective_failure(e)):
            raise
        line = diagnose(e, cfg.log.run_dir, torch.distributed.get_rank(), torch.distributed.get_world_size(),
                        at["step"], cfg.parallel.timeout_s)
        print(line, file=sys.stderr, flush=True)
        raise Ended(HANG_EXIT, line) from None
    finally:
        notice.close()


def _train(cfg: Config, resume, notice: Notice, at: dict):
    t = cfg.train  # with train.init_from, cfg.model is already the checkpoint's (load_config)
    t_start = time.monotonic()
    device = pick_device(cfg)
    # parallel: auto -> a layout; on CUDA the memory plan must fit (pithtrain/plan.py): one-line errors
    check_launch(cfg, device, int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0)))
    dims = ParallelDims.from_config(cfg)  # layout vs WORLD_SIZE and model: fails before any collective
    check_runnable(cfg, device)
    if dims.distributed and device.type == "cuda":
        flight_recorder(cfg.log.run_dir)  # NCCL's last collectives per rank, dumped on a timeout
    dims.init(device, cfg.parallel.timeout_s)  # torchrun's process group and the meshes; nothing for one process
    total, active = param_counts(build_model(cfg.model, init=False), cfg.model)  # meta: whole model
    run_lock = None  # rank 0 locks log.run_dir and checks its storage before anything is built
    if dims.rank == 0:  # (an error ends rank 0, and torchrun ends the other ranks with it)
        run_lock = claim(cfg, total)
    dtype = compute_dtype(cfg, device)
    torch.manual_seed(cfg.train.seed)
    say = dims.rank == 0
    building = phase("building the model", say)

    model = build_model(cfg.model, init=False)  # meta: filled after parallelize (below), on any layout
    model.train()
    use = kernels.configure(t.kernels, device, fp8=t.fp8, fsdp=dims.fsdp_enabled, bf16=dtype == torch.bfloat16,
                            cp=dims.cp_enabled, experts_alone=dims.experts_alone)
    if dims.rank == 0:
        print(kernels.describe(use), flush=True)
    use_kernels(model, use)  # the model's own operators (models/common.py), before parallelize
    chunks = pipeline.prepare(model, cfg, dims) if dims.pp_enabled else None  # keep this stage's part
    parallelize(model, dims, t, device)  # EP -> CP -> activation checkpointing -> compile -> FSDP
    if t.init_from:  # each rank reads only the slices it holds (checkpoint/hf.py)
        try:
            load_hf_into(model, t.init_from, device)
        except (OSError, ValueError, KeyError, SafetensorError) as e:  # each names the file
            raise ConfigError(f"train.init_from: {' '.join(str(e).split())}") from None
        if dims.rank == 0:
            print(f"pithtrain: initialised from Hugging Face checkpoint {t.init_from}", flush=True)
    else:  # CPU draws, block by block, on every layout and device: 1 GPU == N GPUs
        materialize(model, build_model(cfg.model, init=False), device, t.seed)
    optimizer = build_optimizer(model, cfg, device, use)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    building.done()
    with phase("loading the checkpoint and data", say):
        ckpt = Checkpointer(cfg, model, optimizer, scheduler, device)
        start = ckpt.resume(resume)  # steps already done = data position (0: fresh); says what it did
        dp_rank, dp_size = dims.batch_rank, dims.batch_size  # cp ranks share their rows
        global_batch = t.micro_batch_size * t.grad_accum * dp_size
        batches = build_batches(cfg.data, t.seq_len, global_batch, t.seed, hold_out=t.eval_every > 0)
    peak = peak_tflops(device, cfg.log.peak_tflops)
    if dims.rank == 0:
        print(f"pithtrain: {cfg.model.family} {total / 1e6:.2f}M params ({active / 1e6:.2f}M active) | "
              f"device {device} {str(dtype).removeprefix('torch.')} | recipe {cfg.source} | "
              f"run dir {cfg.log.run_dir} | {dims.describe()}", flush=True)
        print("\n".join(startup_lines(cfg, batches)), flush=True)
    if dims.rank == 0 and (disk := disk_estimate(cfg, total)):
        print(disk, flush=True)
    log = StepLog(cfg.log.run_dir, start, enabled=dims.rank == 0, total_steps=t.steps, cfg=cfg)
    autocast = (torch.autocast("cuda", dtype=dtype) if device.type == "cuda" and dtype != torch.float32
                else contextlib.nullcontext())
    runner = pipeline.make_runner(model, chunks, cfg, dims, device, autocast) if chunks else None

    set_aux_loss_scale(model, 1.0 / (t.grad_accum * dp_size))  # mean over the global batch's micro-batches
    history, tokens_since, collapsed, skips = [], 0, collapse_watch(cfg.model), [0, 0]  # consecutive, total

    def boundary() -> tuple[int, bool]:
        """Every rank at once: the notice any rank got (its signal number, 0: none), and whether
        checkpoint.every_minutes made a save due by any rank's clock."""
        due = bool(cfg.checkpoint.every_minutes) and (
            time.monotonic() - ckpt.saved_at >= 60 * cfg.checkpoint.every_minutes)
        signum, due = any_rank([notice.signum, int(due)], dims, ckpt.pg)
        notice.signum = notice.signum or signum
        return signum, bool(due)

    log.tick()
    first = phase("first step" + (" (compiling the layers: can take minutes)" if t.compile else ""), say,
                  announce=True)
    stopped = boundary()[0]  # a notice during start-up: nothing more is trained
    step = start
    try:
        for step in range(start, t.steps) if not stopped else ():
            at["step"] = step + 1
            x_GS, y_GS = batches.batch(step)
            denom = (y_GS != -100).sum().item()  # loss = sum over the global batch / its target count
            micro_batches = []
            for micro in range(t.grad_accum):
                r = rows(micro, dp_rank, dp_size, t.micro_batch_size)
                x_BS, y_BS = x_GS[r].to(device, non_blocking=True), y_GS[r].to(device, non_blocking=True)
                x_BS, y_BS, pos_BS = split_batch(x_BS, y_BS, dims)  # cp: this rank's sequence chunks
                docs_BS = batches.documents(x_BS) if cfg.data.document_mask else None  # cp, pp: refused
                micro_batches.append((x_BS, y_BS, pos_BS, docs_BS))
            evaluating = bool(t.eval_every) and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps)
            logged = (step + 1) % cfg.log.every == 0 or step + 1 == t.steps or evaluating  # val_loss logs
            done = train_step(model, optimizer, scheduler, micro_batches, denom, cfg, dims, autocast,
                              runner=runner, step=step, metrics=logged)
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
                with log.excluded():  # evaluation time is not training throughput (tokens/s)
                    val = evaluate(model, batches, cfg, dims, device, autocast, lambda: boundary()[0] > 0)
                if val is not None:
                    rec["val_loss"] = val
            history.append(rec)
            tokens_since += done.tokens
            if logged:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = log.tick()
                tps = tokens_since / dt
                tokens_since = 0
                mem = memory_gb(device)
                extra = {}
                if dims.distributed and mem is not None:  # every rank's peak (pipeline stages differ)
                    extra["mem_gb_ranks"] = all_sum([mem if r == dims.rank else 0.0 for r in range(dims.world_size)],
                                                    dims)
                # FLOPs of what the logged step computed where the routing decides it (slots dropped)
                fpt = flops_per_token(cfg.model, t.seq_len, done.routing.get("computed_slots_per_token"))
                log.write({**rec, "tokens_per_s": tps,  # all ranks together; MFU is per GPU
                           "mfu": tps * fpt / (peak * 1e12 * dims.world_size) if peak else None,
                           "mem_gb": mem, **done.routing, **extra})
                if dims.rank == 0 and (warning := collapsed(done.routing)):
                    print(warning, flush=True)
            stopped, due = boundary()
            ckpt.after_step(step + 1, now=bool(stopped) or due)  # when due (every, every_minutes, final), or a notice
            if stopped:
                step += 1
                break
    except BaseException:  # one process: a save of an earlier step still in flight is committed
        ckpt.abort()
        if run_lock is not None:
            run_lock.close()
        raise
    ckpt.close()  # an asynchronous save still in flight is finished and committed
    if cfg.checkpoint.export_hf and start < t.steps and not stopped:
        export_final(cfg)
    log.close()
    if stopped:
        kept = step_dirs(checkpoints_dir(cfg.log.run_dir))
        line = (f"pithtrain: stopped at step {step} by {signal.Signals(stopped).name}; "
                f"{f'saved {kept[0].name}; run again to resume' if kept else 'nothing saved yet; run again to start'}")
    if dims.rank == 0:
        print(line if stopped else summary_line(cfg, history, batches, global_batch, time.monotonic() - t_start),
              flush=True)
    if run_lock is not None:  # after the last commit: the run dir is ours until then
        run_lock.close()
    dims.close()
    if stopped:
        raise Ended(128 + stopped, line)
    return history, model


def export_final(cfg: Config):
    """checkpoint.export_hf: the final checkpoint, as <run_dir>/hf (every rank writes its shards)."""
    from pathlib import Path

    from pithtrain.checkpoint.dcp import checkpoints_dir
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
    p.add_argument("--check", type=int, metavar="WORLD", help="only check the recipe for WORLD processes (invoke train)")
    args = p.parse_intermixed_args(argv)  # flags may sit between overrides
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe:  # only overrides were given
        recipe, overrides = None, [recipe, *overrides]
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(recipe, overrides)
        if args.check:  # parallel: auto's layout (no memory plan off the GPU; rank -1: silent), then the world size
            check_launch(cfg, torch.device("cpu"), args.check, rank=-1)
            ParallelDims.from_config(cfg, args.check, rank=0)
            return 0
        train(cfg, resume=False if args.no_resume else (args.resume or True))
    except Ended as e:  # a notice (128 + its signal's number) or a collective timed out: the line is out
        return e.code
    except KeyboardInterrupt:  # before train() took SIGINT over
        stopped_early()
    except (ConfigError, CheckpointError) as e:  # every rank meets the same one: rank 0 says it, and torchrun
        time.sleep(5 if rank else 0)  # ends the others while they wait; one still here met its own (a file only it reads)
        print(f"error: {f'rank {rank}: ' if rank else ''}{e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # training diverged: the weights and checkpoints stay finite
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # main() and train() take Ctrl-C from here
    sys.exit(main())
