"""Profile a few training steps and say where the time goes. Prints PASS or FAIL.

    python skills/capture-profile/scripts/capture.py                        # tiny default (CPU or GPU)
    python skills/capture-profile/scripts/capture.py deepseek-v2-lite train.steps=6 ...   # recipe + overrides
    torchrun --nproc-per-node 8 skills/capture-profile/scripts/capture.py RECIPE parallel.ep=8   # per rank
    python skills/capture-profile/scripts/capture.py --tool nsys RECIPE      # Nsight Systems (GPU + nsys)

--tool auto (default) uses Nsight Systems when `nsys` is on PATH and a GPU is visible, and
torch.profiler otherwise (and when nsys fails). The profiler skips the first `--skip` optimizer
steps (compile, allocator warm-up) and records the rest.

Writes <out>/trace_rank<R>.json (torch.profiler: chrome trace; open in https://ui.perfetto.dev) or
<out>/profile.nsys-rep + .sqlite (nsys: open in nsys-ui), and prints:
  - the top ops / kernels by self time;
  - busy time: the union of all device kernels (GPU) or host ops (CPU) on the timeline;
  - communication share: time covered by collectives (NCCL / Gloo kernels or ops) / busy time;
  - exposed communication: collective time with no compute running on another stream or thread at
    the same moment (what overlap failed to hide; DualPipeV exists to drive this to zero).
PASS: a trace with events was written and 0 <= exposed <= communication <= busy; with
--max-exposed-share X also exposed / busy <= X. Exit status 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

COMM = re.compile(r"(?i)nccl|gloo|c10d::|record_param_comms|all_?reduce|all_?gather|reduce_?scatter"
                  r"|all_?to_?all|broadcast_|sendrecv")
TINY = ["train.steps=5", "train.micro_batch_size=4", "train.seq_len=64", "train.warmup_steps=1",
        "model.hidden_size=64", "model.num_heads=4", "model.head_dim=16", "model.moe_intermediate_size=64",
        "model.num_layers=2", "data.max_bytes=300000", "log.every=5", "checkpoint.final=false"]


# ---------------------------------------------------------------------------------------------
# Interval arithmetic on (start, end) microseconds


def union(iv):
    out = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def subtract(a, b):
    """Parts of the (merged) intervals `a` not covered by the (merged) intervals `b`."""
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append([cur, b[k][0]])
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append([cur, e])
    return out


def length(iv) -> float:
    return sum(e - s for s, e in iv)


def summarize(events) -> dict:
    """events: (name, lane, start_us, end_us). Lanes are streams (GPU) or threads (CPU): work on the
    same lane is serial (or nested), so only other lanes can hide a collective."""
    comm = [ev for ev in events if COMM.search(ev[0])]
    exposed = []
    for lane in {ev[1] for ev in comm}:
        mine = union([(s, e) for _, ln, s, e in comm if ln == lane])
        others = union([(s, e) for n, ln, s, e in events if ln != lane and not COMM.search(n)])
        exposed += subtract(mine, others)
    return {"events": len(events), "busy_us": length(union([(s, e) for *_, s, e in events])),
            "comm_us": length(union([(s, e) for *_, s, e in comm])), "exposed_us": length(union(exposed))}


def top_table(events, n=15) -> str:
    """Total time per name (kernels do not nest; for host ops this is inclusive time)."""
    tot, cnt = {}, {}
    for name, _, s, e in events:
        tot[name] = tot.get(name, 0.0) + e - s
        cnt[name] = cnt.get(name, 0) + 1
    rows = sorted(tot.items(), key=lambda kv: -kv[1])[:n]
    lines = [f"{'total ms':>10} {'calls':>6}  name"]
    lines += [f"{t / 1e3:10.3f} {cnt[k]:6d}  {k[:100]}" for k, t in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# torch.profiler


def chrome_events(trace: Path):
    evs = [e for e in json.loads(trace.read_text()).get("traceEvents", [])
           if e.get("ph") == "X" and "dur" in e]
    device = [e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    chosen = device or [e for e in evs if e.get("cat") == "cpu_op"]
    return [(e["name"], (e.get("pid"), e.get("tid")), float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            for e in chosen], bool(device)


def run_torch_profiler(cfg, out: Path, skip: int, rank: int):
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, schedule

    from pithtrain.train import train

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    active = max(cfg.train.steps - skip, 1)
    prof = profile(activities=activities, schedule=schedule(wait=max(skip - 1, 0), warmup=min(skip, 1),
                                                            active=active, repeat=1))
    # the trainer's loop has no profiler argument: advance the schedule after every optimizer step
    hook = register_optimizer_step_post_hook(lambda *a, **k: prof.step())
    try:
        with prof:
            train(cfg, resume=False)
    finally:
        hook.remove()
    trace = out / f"trace_rank{rank}.json"
    prof.export_chrome_trace(str(trace))
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    try:
        table = prof.key_averages().table(sort_by=sort, row_limit=15)
    except Exception:  # older/newer key names: fall back to our own table from the trace
        table = None
    events, on_device = chrome_events(trace)
    return trace, events, on_device, table


# ---------------------------------------------------------------------------------------------
# Nsight Systems


def run_nsys(recipe_args: list[str], out: Path):
    """nsys profile the trainer, export sqlite, read the kernel table. None if nsys fails."""
    rep = out / "profile"
    cmd = ["nsys", "profile", "--trace=cuda,nvtx,osrt", "--force-overwrite=true", "--export=sqlite",
           "-o", str(rep), sys.executable, "-m", "pithtrain.train", "--no-resume", *recipe_args]
    print("+ " + " ".join(cmd), flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(cmd, cwd=ROOT, env=env)
    db = rep.with_suffix(".sqlite")
    if r.returncode != 0 or not db.is_file():
        print(f"nsys failed (exit {r.returncode}); falling back to torch.profiler", flush=True)
        return None
    con = sqlite3.connect(db)
    rows = con.execute("SELECT s.value, k.deviceId, k.streamId, k.start, k.end FROM CUPTI_ACTIVITY_KIND_KERNEL k "
                       "JOIN StringIds s ON s.id = k.shortName").fetchall()
    con.close()
    # nsys times are nanoseconds
    return rep.with_suffix(".nsys-rep"), [(n, (d, st), s / 1e3, e / 1e3) for n, d, st, s, e in rows]


# ---------------------------------------------------------------------------------------------
# Entry point


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="?", default=None, help="recipe file or embedded name (default: tiny default)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.add_argument("--tool", choices=["auto", "torch", "nsys"], default="auto")
    p.add_argument("--skip", type=int, default=2, help="optimizer steps not recorded (warm-up)")
    p.add_argument("--out", default="runs/profile", help="folder for traces (relative to the repo root)")
    p.add_argument("--max-exposed-share", type=float, default=None,
                   help="FAIL if exposed communication / busy time exceeds this (e.g. 0.05)")
    args = p.parse_args(argv)
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe:
        recipe, overrides = None, [recipe, *overrides]
    if recipe is None:  # the tiny default: seconds on a CPU
        overrides = TINY + overrides
    out = (ROOT / args.out).resolve()
    rank = int(os.environ.get("RANK", "0"))
    out.mkdir(parents=True, exist_ok=True)

    import torch

    from pithtrain.config import load_config

    tool = args.tool
    if tool == "auto":
        tool = "nsys" if shutil.which("nsys") and torch.cuda.is_available() and "RANK" not in os.environ else "torch"
    overrides = overrides + [f"log.run_dir={out / 'run'}"]  # shared by all ranks; never resumed from
    result, table, on_device = None, None, True
    if tool == "nsys":
        result = run_nsys(([recipe] if recipe else []) + overrides, out)
    if result is None:
        tool = "torch.profiler"
        cfg = load_config(recipe, overrides)
        if cfg.train.steps <= args.skip:
            sys.exit(f"error: train.steps ({cfg.train.steps}) must exceed --skip ({args.skip})")
        trace, events, on_device, table = run_torch_profiler(cfg, out, args.skip, rank)
    else:
        trace, events = result

    s = summarize(events)
    print(f"\n== {tool}: top {'kernels' if on_device else 'ops'} (rank {rank}) ==")
    print(table or top_table(events))
    busy, comm, exposed = s["busy_us"], s["comm_us"], s["exposed_us"]
    share = comm / busy if busy else 0.0
    exposed_share = exposed / busy if busy else 0.0
    print(f"trace                  {trace}")
    print(f"timeline               {'device kernels' if on_device else 'host ops'}, {s['events']} events")
    print(f"busy time              {busy / 1e3:10.3f} ms")
    print(f"communication          {comm / 1e3:10.3f} ms  ({100 * share:.1f}% of busy)")
    print(f"exposed communication  {exposed / 1e3:10.3f} ms  ({100 * exposed_share:.1f}% of busy)")
    by_name = {}
    for name, _, t0, t1 in events:
        if COMM.search(name):
            by_name[name] = by_name.get(name, 0.0) + t1 - t0
    for name, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  collective {t / 1e3:10.3f} ms  {name[:90]}")
    problems = []
    if not Path(trace).is_file() or Path(trace).stat().st_size == 0 or not events:
        problems.append("no trace events were recorded")
    if not (0 <= exposed <= comm + 1e-6 <= busy + 2e-6) or busy <= 0:
        problems.append("inconsistent totals (expected 0 <= exposed <= communication <= busy, busy > 0)")
    if args.max_exposed_share is not None and exposed_share > args.max_exposed_share:
        problems.append(f"exposed communication {100 * exposed_share:.1f}% > {100 * args.max_exposed_share:.1f}%")
    for msg in problems:
        print(f"problem: {msg}")
    print("FAIL" if problems else "PASS")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
