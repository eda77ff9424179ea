"""Where the host's time goes in the bench's step (pithtrain.bench.pithtrain_step) on one GPU: for
each micro-batch count, the step's wall time against the GPU's busy time, the GPU's idle gaps (the
largest, with the host call that launched the kernel after each), and the host's Python profile.

    python scripts/step_probe.py --model deepseek-v2-lite --grad-accum 1,8 --out DIR

Writes DIR/trace_mbN.json.gz (torch.profiler, one step) and DIR/cprofile_mbN.txt; prints a summary.
"""

from __future__ import annotations

import argparse
import bisect
import cProfile
import gzip
import io
import json
import os
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

from launch_probe import timed  # scripts/ is on the path when a script runs
from pithtrain.bench import bench_config, parse_variant, pithtrain_step


def gaps(trace: dict, top: int = 12) -> tuple[float, float, list]:
    """(GPU busy ms, idle ms inside the step, the largest idle gaps as (ms, at ms, launching op))."""
    ev = trace["traceEvents"]
    kern = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    launch = {e["args"].get("correlation"): e for e in ev if e.get("cat") == "cuda_runtime"}
    cpu = sorted((e for e in ev if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    starts = [c["ts"] for c in cpu]
    t0, busy, end, found = kern[0]["ts"], 0.0, kern[0]["ts"], []
    for k in kern:
        if k["ts"] > end:
            rt = launch.get(k["args"].get("correlation"))
            owner = ""
            if rt is not None and k["ts"] - end > 50:  # the innermost CPU op around the launch
                i = bisect.bisect_right(starts, rt["ts"])
                around = [c for c in cpu[max(0, i - 300):i] if rt["ts"] <= c["ts"] + c.get("dur", 0)]
                owner = around[-1]["name"] if around else rt["name"]
            found.append(((k["ts"] - end) / 1e3, (end - t0) / 1e3, owner[:60]))
        busy += max(0.0, k["ts"] + k.get("dur", 0) - max(end, k["ts"]))
        end = max(end, k["ts"] + k.get("dur", 0))
    idle = sum(g for g, _, _ in found)
    return busy / 1e3, idle, sorted(found, reverse=True)[:top]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--variant", default="fused+compile+bf16")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--grad-accum", default="1,8")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    for accum in (int(a) for a in args.grad_accum.split(",")):
        cfg = bench_config(args.model, args.layers, 2, 4096, accum)
        model, step = pithtrain_step(cfg, parse_variant(args.variant), dev)
        host_us, step_us = timed(step, 3)  # the host's time per step includes the step's own syncs
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        path = os.path.join(args.out, f"trace_mb{accum}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        with gzip.open(path + ".gz", "wt") as f:
            json.dump(trace, f)
        os.remove(path)
        busy, idle, top = gaps(trace)
        pr = cProfile.Profile()
        pr.enable()
        step()
        torch.cuda.synchronize()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(45)
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(60)
        with open(os.path.join(args.out, f"cprofile_mb{accum}.txt"), "w") as f:
            f.write(s.getvalue())
        print(f"== {args.model} {args.variant} {accum} mb: host {host_us / 1e3:.1f} ms of a {step_us / 1e3:.1f} ms "
              f"step; profiled step: GPU busy {busy:.1f} ms, idle gaps {idle:.1f} ms", flush=True)
        for g, at, owner in top:
            print(f"   gap {g:7.2f} ms at {at:8.1f} ms before a kernel launched in {owner}")
        del model, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
