"""Every parallel layout on N GPUs against one GPU, on a small DeepSeek-V2-shaped model (issue 10).

    python scripts/multi_gpu_parity.py --out runs/parity                # 2 GPUs, NCCL, bf16
    python scripts/multi_gpu_parity.py --device cpu --steps 4 --out /tmp/p   # gloo smoke check

Each layout trains `--steps` steps through torchrun on the same global batch as the one-process
baseline; the table compares the per-step losses. The bf16 band is measured, not assumed: a second
one-process run splits the same global batch into twice as many micro-batches (the same function,
summed in another order), and its largest loss deviation from the baseline is the noise floor of
bf16 reduction order on this machine. A layout passes within max(3 x that floor, 0.5%). The
load-balancing loss is off (its parity across layouts is proven in float32 by the CPU tests).
The last rows time DualPipeV in pp=2 x fsdp=2 x ep=2 (4 processes: skipped with fewer) with the
overlap on (each micro-batch's expert all-to-all under another's compute) and off, and check in
each run's pipeline timeline that the overlap ran exactly where the label says.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

MODEL = ("model.num_layers=4 model.hidden_size=512 model.num_heads=8 model.kv_lora_rank=128 model.qk_nope_head_dim=64 "
         "model.qk_rope_head_dim=32 model.v_head_dim=64 model.intermediate_size=1024 model.moe_intermediate_size=256 "
         "model.num_experts=16 model.top_k=4 model.n_shared_experts=1 model.vocab_size=264 model.aux_loss_coeff=0 "
         "train.compile=false train.warmup_steps=5 train.lr=1e-3").split()

# name -> (overrides, micro_batch_size scale, processes); every layout sees 4 micro-batches per step
# and the same global batch (fsdp/dp ranks take half the rows of each micro-batch each; cp and pp
# ranks share). The overlap rows need expert parallelism inside a pipeline stage: 4 processes.
PP_EP = ["parallel.pp=2", "parallel.fsdp=2", "parallel.ep=2", "parallel.pp_schedule=dualpipev"]
LAYOUTS = {
    "fsdp=2": (["parallel.fsdp=2"], 0.5, 2),
    "ep=2 (fsdp=2)": (["parallel.fsdp=2", "parallel.ep=2"], 0.5, 2),
    "cp=2": (["parallel.cp=2"], 1, 2),
    "pp=2 1f1b": (["parallel.pp=2", "parallel.pp_schedule=1f1b"], 1, 2),
    "pp=2 dualpipev": (["parallel.pp=2", "parallel.pp_schedule=dualpipev"], 1, 2),
    "pp=2 x fsdp=2 x ep=2 dualpipev, overlap": ([*PP_EP, "parallel.pp_overlap=true"], 0.5, 4),
    "pp=2 x fsdp=2 x ep=2 dualpipev, no overlap": ([*PP_EP, "parallel.pp_overlap=false"], 0.5, 4),
}
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def launch(name: str, train_args: list[str], nproc: int, run_dir: Path, log) -> list[dict] | None:
    """`python -m pithtrain.train TRAIN_ARGS` into run_dir (torchrun on a free port when nproc > 1,
    NVLink multicast off); its command and output go to `log`. Its metrics.jsonl records, or None
    when it failed. scripts/paper_config.py runs its layouts through it too."""
    cmd = ["-m", "pithtrain.train", *train_args, f"log.run_dir={run_dir}", "--no-resume"]
    if nproc > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            cmd = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                   str(s.getsockname()[1]), *cmd]
    cmd = [sys.executable, *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **MULTICAST_OFF})
    print(f"=== {name} (exit {p.returncode}): {' '.join(cmd)}\n{p.stdout}\n{p.stderr}", file=log, flush=True)
    metrics = run_dir / "metrics.jsonl"
    if p.returncode != 0 or not metrics.exists():
        return None
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def overlap_as_labelled(run_dir: Path, overlap: bool) -> tuple[list[int], bool]:
    """Per rank, the expert all-to-all phases of the last step that ran under another micro-batch's
    compute (the run's pipeline timeline), and whether that is what the label says: some on every
    rank with the overlap on, none anywhere with it off."""
    from pithtrain.pipeline_viz import load, overlapped
    n = [overlapped(r) for r in load(run_dir)]
    return n, min(n) > 0 if overlap else max(n) == 0


def max_rel(a, b):
    return max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b))


def median_tps(recs):  # past the first quarter's warm-up
    return statistics.median(r["tokens_per_s"] for r in recs[len(recs) // 4:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for run dirs, log.txt and parity.json")
    ap.add_argument("--runs", default=None, help="where the run directories go (default: OUT/runs)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--nproc", type=int, default=2, help="the most processes a layout may use")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=4, help="one-process micro-batch size")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    log = open(Path(args.out) / "log.txt", "w")
    mb, common = args.micro_batch, [f"train.device={args.device}", f"train.steps={args.steps}", "train.grad_accum=4",
                                    f"train.seq_len={args.seq_len}", "log.every=1", "checkpoint.final=false",
                                    *(["train.dtype=float32"] if args.device == "cpu" else [])]

    def run(name, overrides, nproc):
        return launch(name, ["deepseek-v2-lite", *MODEL, *common, *overrides], nproc, run_dir_of(name), log)

    def run_dir_of(name) -> Path:
        return Path(args.runs or Path(args.out) / "runs") / "".join(c for c in name.replace(" ", "_")
                                                                     if c.isalnum() or c == "_")

    base = run("baseline 1 process", [f"train.micro_batch_size={mb}"], 1)
    if base is None:
        print(f"baseline failed; see {args.out}/log.txt")
        return 1
    split = run("baseline split micro-batches", [f"train.micro_batch_size={mb // 2}", "train.grad_accum=8"], 1)
    noise = max_rel(split, base) if split else float("nan")
    band = max(3 * noise, 5e-3)
    rows = []
    for name, (overrides, scale, nproc) in LAYOUTS.items():
        rows.append(row := {"layout": name})
        if nproc > args.nproc:
            row["status"] = f"SKIPPED (needs {nproc} processes, --nproc {args.nproc})"
            continue
        recs = run(name, overrides + [f"train.micro_batch_size={int(mb * scale)}"], nproc)
        if recs is None:
            row["status"] = "FAILED (see log.txt)"
            continue
        if "dualpipev" in name:  # what the label says ran (the last step's pipeline timeline)
            n, as_labelled = overlap_as_labelled(run_dir_of(name), "parallel.pp_overlap=true" in overrides)
            if not as_labelled:
                row["status"] = f"FAIL (overlapped all-to-all per rank {n})"
                continue
        d = max_rel(recs, base)
        row.update(max_rel_loss_diff=d, tokens_per_s=median_tps(recs), peak_mem_gb=max(r["mem_gb"] or 0 for r in recs),
                   status="PASS" if d <= band else "FAIL", losses=[r["loss"] for r in recs])
    ok = not any(r["status"].startswith("FAIL") for r in rows)
    result = {"steps": args.steps, "device": args.device, "nproc": args.nproc, "noise_floor": noise, "band": band,
              "baseline_losses": [r["loss"] for r in base], "baseline_tokens_per_s": median_tps(base), "layouts": rows}
    (Path(args.out) / "parity.json").write_text(json.dumps(result, indent=1))
    print(f"baseline: 1 process, {result['baseline_tokens_per_s']:.0f} tok/s; losses {base[0]['loss']:.4f} -> "
          f"{base[-1]['loss']:.4f}; bf16 reduction-order floor {noise:.2e}, band {band:.2e}")
    print(f"| layout | max rel. loss diff over {args.steps} steps | tokens/s | peak mem GB | verdict |\n"
          "| --- | --- | --- | --- | --- |")
    for r in rows:
        cells = ([f"{r['max_rel_loss_diff']:.2e}", f"{r['tokens_per_s']:.0f}", f"{r['peak_mem_gb']:.1f}"]
                 if "losses" in r else ["-"] * 3)
        print(f"| {r['layout']} | {' | '.join(cells)} | {r['status']} |")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
