"""train.state=lean against float32 (issue 48): the loss curves of the same seed, against the spread
of two float32 seeds, with each run's step time and peak memory. PASS when the lean curve stays
within the seed spread.

    python scripts/lean_check.py                        # GPU: Qwen3-30B-A3B, 4 layers at real width, 300 steps
    python scripts/lean_check.py --recipe deepseek-v2-lite
    python scripts/lean_check.py --recipe default --layers 0 --steps 300 --set train.dtype=bfloat16   # CPU

Three runs, one after the other in this process, each the train loop's own step (train.train_step)
from a fresh build: float32 with train.seed S, float32 with S + 1, lean with S (the seed draws the
weights and orders the batches). A curve is each step's training loss, smoothed by a running mean
of --window steps (one step's loss swings with its batch); the spread is the largest gap between the
two float32 curves after warmup, the lean gap the largest between lean and float32 of seed S.
The GPU default leaves out compile and recomputation (neither changes the numbers) so that the
three runs fit about 4 minutes on an H200; weights are drawn on the device.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from pithtrain import plan
from pithtrain.build import build_run, check_run
from pithtrain.config import load_config
from pithtrain.data import build_batches
from pithtrain.train import micro_batches, train_step

GPU_SET = ["train.compile=false", "train.activation_checkpoint=none", "log.every=1000000",
           "train.global_batch_tokens=16384"]


def run(cfg, device: torch.device) -> dict:
    """The losses, the median step seconds after the first 10, and the peak memory of one run."""
    t = cfg.train
    torch.manual_seed(t.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    built = build_run(cfg, device, check_run(cfg, device, 1), draws="device")
    batches = build_batches(cfg.data, t.seq_len, t.micro_batch_size * t.grad_accum, t.seed)
    losses, seconds = [], []
    for step in range(t.steps):
        x, y = batches.batch(step)
        start = time.perf_counter()
        done = train_step(built, micro_batches(built, batches, x, y), (y != -100).sum().item(), step)
        seconds.append(time.perf_counter() - start)  # train_step waits for the step (its loss, its norm)
        losses.append(done.loss)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    del built
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"loss": losses, "step_s": statistics.median(seconds[10:] or seconds), "peak_gib": peak}


def smooth(xs: list[float], window: int) -> list[float]:
    return [sum(xs[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(xs))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4, help="model.num_layers (0: the recipe's)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--window", type=int, default=20, help="steps of the running mean")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides")
    ap.add_argument("--json", help="write the curves and figures here")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    over = [f"train.steps={args.steps}", *([f"model.num_layers={args.layers}"] if args.layers else []),
            *(GPU_SET if device.type == "cuda" else ["train.device=cpu", "log.every=1000000"]), *args.set]
    cfg = load_config(args.recipe, over)
    if cfg.parallel.auto:
        cfg, _ = plan.resolve(cfg, 1)
    if device.type == "cuda":  # two micro-batches of 2 x 4096 a step: the lean state's float32 accumulation runs
        cfg.train.micro_batch_size, cfg.train.grad_accum = 2, 2
    seed = cfg.train.seed
    print(f"lean_check: {args.recipe} {cfg.model.num_layers} layers, {args.steps} steps of "
          f"{cfg.train.micro_batch_size * cfg.train.grad_accum} x {cfg.train.seq_len} tokens on {device}", flush=True)
    runs = {}
    for name, state, s in (("float32", "float32", seed), (f"float32 seed {seed + 1}", "float32", seed + 1),
                           ("lean", "lean", seed)):
        one = load_config(args.recipe, over + [f"train.state={state}", f"train.seed={s}"])
        one.parallel, one.train.micro_batch_size, one.train.grad_accum = (
            cfg.parallel, cfg.train.micro_batch_size, cfg.train.grad_accum)
        runs[name] = r = run(one, device)
        print(f"  {name:<20} loss {r['loss'][0]:.4f} -> {statistics.mean(r['loss'][-args.window:]):.4f} "
              f"(last {args.window}), step {r['step_s'] * 1e3:.1f} ms, peak {r['peak_gib']:.1f} GiB"
              + (" (CPU: not measured)" if device.type == "cpu" else ""), flush=True)
    curves = {k: smooth(r["loss"], args.window) for k, r in runs.items()}
    start = min(cfg.train.warmup_steps + args.window, args.steps - 1)
    a, b, lean = curves.values()
    spread = max(abs(x - y) for x, y in zip(a[start:], b[start:]))
    gap = max(abs(x - y) for x, y in zip(a[start:], lean[start:]))
    ok = gap <= spread
    print(f"lean_check: from step {start + 1}: lean vs float32 max gap {gap:.4f}, float32 seed spread "
          f"{spread:.4f}: {'PASS' if ok else 'FAIL'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "gap": gap, "spread": spread, "from_step": start + 1, "set": over}, f)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
