"""Measure training throughput for a recipe and compare it with a saved baseline. Prints PASS or FAIL.

    python skills/benchmark-throughput/scripts/throughput.py                              # tiny default (CPU ok)
    python skills/benchmark-throughput/scripts/throughput.py deepseek-v2-lite model.num_layers=4 \\
        train.global_batch_tokens=null train.micro_batch_size=2 train.seq_len=4096 train.device=cuda \\
        --steps 12 --save runs/bench/before.json
    python skills/benchmark-throughput/scripts/throughput.py ... --baseline runs/bench/before.json --tolerance 0.03

Runs `--steps` optimizer steps of the trainer (log.every=1, no checkpoints), drops the first
`--warmup` (compile, autotuning, allocator), and reports the median tokens/s, MFU (where the GPU's
peak is known), peak memory, and the per-step spread. The record (date, host, commit, torch, device,
recipe and overrides, figures) is printed as JSON and written to --save if given. The run's own
directory (metrics.jsonl) is --out, or a temporary folder that is printed and removed.
PASS: every step finite, median tokens/s > 0, and with --baseline: median >= baseline * (1 - tolerance)
(the same recipe and overrides are required, or it FAILs as not comparable). Exit status 0 / 1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

TINY = ["train.micro_batch_size=4", "train.seq_len=64", "train.warmup_steps=2", "model.hidden_size=64",
        "model.num_heads=4", "model.head_dim=16", "model.moe_intermediate_size=64", "model.num_layers=2",
        "data.max_bytes=300000"]


# ---------------------------------------------------------------------------------------------
# Measure


def commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "pithtrain"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return (r.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def measure(recipe: str | None, overrides: list[str], steps: int, warmup: int, out: Path | None) -> dict:
    import torch

    from pithtrain.config import load_config
    from pithtrain.train import train

    with contextlib.ExitStack() as stack:
        if out is None:
            out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pithtrain-bench-")))
            print(f"run dir {out} (temporary: removed at the end; --out DIR keeps it)", flush=True)
        cfg = load_config(recipe, overrides + [f"train.steps={steps}", "log.every=1", "checkpoint.final=false",
                                               "checkpoint.every=0", f"log.run_dir={out}"])
        hist, _ = train(cfg, resume=False)
        recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in recs if r["step"] > warmup]
    tps = [r["tokens_per_s"] for r in timed]
    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "commit": commit(), "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and cfg.train.device != "cpu" else "cpu",
        "recipe": recipe or "default", "overrides": overrides, "steps": steps, "warmup": warmup,
        "tokens_per_s": statistics.median(tps) if tps else 0.0,
        "tokens_per_s_min": min(tps, default=0.0), "tokens_per_s_max": max(tps, default=0.0),
        "mfu": statistics.median(mfu) if mfu else None,
        "mem_gb": max((r.get("mem_gb") or 0.0) for r in recs) if recs else None,
        "finite": all(math.isfinite(h["loss"]) for h in hist),
    }


# ---------------------------------------------------------------------------------------------
# Entry point


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="?", default=None, help="recipe file or embedded name (default: tiny default)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps in total")
    p.add_argument("--warmup", type=int, default=3, help="first steps not timed")
    p.add_argument("--save", type=Path, help="write the record here (JSON)")
    p.add_argument("--out", type=Path, help="run dir of the measured run, kept (default: a temporary one)")
    p.add_argument("--baseline", type=Path, help="a record written by --save to compare against")
    p.add_argument("--tolerance", type=float, default=0.05, help="allowed fractional slowdown vs --baseline")
    args = p.parse_args(argv)
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe:
        recipe, overrides = None, [recipe, *overrides]
    if recipe is None:
        overrides = TINY + overrides
    if args.steps <= args.warmup:
        sys.exit(f"error: --steps ({args.steps}) must exceed --warmup ({args.warmup})")

    rec = measure(recipe, overrides, args.steps, args.warmup, args.out)
    print(json.dumps(rec, indent=1))
    problems = []
    if not rec["finite"]:
        problems.append("a loss was not finite")
    if not rec["tokens_per_s"] > 0:
        problems.append("no throughput measured")
    mfu = f", MFU {100 * rec['mfu']:.1f}%" if rec["mfu"] is not None else ""
    print(f"throughput: {rec['tokens_per_s']:,.0f} tokens/s median over {args.steps - args.warmup} steps "
          f"(min {rec['tokens_per_s_min']:,.0f}, max {rec['tokens_per_s_max']:,.0f}){mfu}, "
          f"{rec['device']}, commit {rec['commit']}")
    if args.baseline:
        base = json.loads(args.baseline.read_text())
        if (base["recipe"], base["overrides"]) != (rec["recipe"], rec["overrides"]):
            problems.append(f"{args.baseline}: a different recipe or overrides; not comparable")
        else:
            ratio = rec["tokens_per_s"] / base["tokens_per_s"]
            print(f"vs baseline {args.baseline} (commit {base['commit']}): {ratio:.3f}x")
            if ratio < 1 - args.tolerance:
                problems.append(f"{100 * (1 - ratio):.1f}% slower than the baseline (tolerance "
                                f"{100 * args.tolerance:.1f}%)")
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(json.dumps(rec, indent=1) + "\n")
        print(f"wrote {args.save}")
    for msg in problems:
        print(f"problem: {msg}")
    print("FAIL" if problems else "PASS")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
