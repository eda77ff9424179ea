"""The PithTrain paper's 8-GPU configuration (issue 11): full DeepSeek-V2-Lite (27 layers), PP=4 x
EP=2 (FSDP=2, from which EP borrows its ranks), sequence 2048, global batch 1024, bf16.

    python scripts/paper_config.py --out runs/paper            # 8 GPUs, NCCL: the three runs below
    python scripts/paper_config.py --smoke --out /tmp/paper    # 8 gloo processes on CPU, tiny widths

Runs (torchrun, NVLink multicast off in every process):
  1. DualPipeV with the overlap (parallel.pp_overlap=true: each micro-batch's expert all-to-all runs
     under another's compute), `--steps` (25) steps: median tokens/s of the last 10, per GPU, MFU,
     peak memory per rank;
  2. DualPipeV without it (pp_overlap=false), the same; 3. 1F1B, the same;
  4. DualPipeV with the overlap, `--loss-steps` (64) steps: the loss must fall and stay finite (0 skips it).
Each run's last-step pipeline timeline must show what its label says: overlapped all-to-all
phases on every rank for the overlap runs, none for the others (else FAIL).
Global batch = micro-batch x grad_accum x batch ranks (fsdp = 2): 4 x 128 x 2 = 1024 sequences.
Writes OUT/log.txt (every command, its output), OUT/paper.json; prints a table last, each timed run
beside perf.py's prediction for its layout on the GPU the run found (predicted / measured).
Published reference: torchtitan's DeepSeek "16B" (the same shape), ~11.6K tokens/s/GPU on 8 x H100.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from multi_gpu_parity import launch, overlap_as_labelled  # the sibling script (python puts scripts/ on the path)

LAYOUT = ("parallel.pp=4 parallel.fsdp=2 parallel.ep=2 train.seq_len=2048 train.micro_batch_size=4 "
          "train.grad_accum=128 train.global_batch_tokens=null "
          "train.dtype=bfloat16 train.lr=3e-4 train.warmup_steps=10 log.every=1 checkpoint.final=false").split()
# --smoke: the same layout and schedules with tiny widths (8 layers: 2 per stage), on CPU.
SMOKE = ("model.num_layers=8 model.hidden_size=64 model.num_heads=2 model.kv_lora_rank=32 model.qk_nope_head_dim=16 "
         "model.qk_rope_head_dim=8 model.v_head_dim=16 model.intermediate_size=128 model.moe_intermediate_size=32 "
         "model.num_experts=8 model.top_k=2 model.vocab_size=264 train.seq_len=64 train.micro_batch_size=1 "
         "train.grad_accum=8 train.dtype=float32 train.device=cpu train.compile=false").split()


def summary(name: str, recs: list[dict]) -> dict:
    tps = statistics.median(r["tokens_per_s"] for r in recs[-10:])
    mfu = [r["mfu"] for r in recs[-10:] if r.get("mfu") is not None]
    return {"run": name, "steps": len(recs), "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / 8,
            "mfu": statistics.median(mfu) if mfu else None, "peak_mem_gb_per_rank": recs[-1].get("mem_gb_ranks"),
            "loss_first": recs[0]["loss"], "loss_last": recs[-1]["loss"],
            "finite": all(math.isfinite(r["loss"]) for r in recs)}


def prediction(overrides: list[str], smoke: bool) -> float | None:
    """The performance model's tokens/s per GPU for a run's layout on this machine's GPU (None on
    CPU or an unknown GPU: nothing to predict)."""
    import torch

    from pithtrain import perf
    from pithtrain.config import load_config
    from pithtrain.gpus import gpu_key
    from pithtrain.plan import layout_of, resolve
    key = gpu_key(torch.cuda.get_device_name()) if torch.cuda.is_available() and not smoke else None
    if key is None:
        return None
    # the sizes LAYOUT leaves to `parallel: auto` (dp, cp), as train.py resolves them
    cfg = resolve(load_config("deepseek-v2-lite", [*LAYOUT, *overrides]), 8, key)[0]
    return perf.predict(cfg, layout_of(vars(cfg.parallel)), key)["tokens_per_s_per_gpu"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=25, help="steps of each timed run (median of the last 10)")
    ap.add_argument("--loss-steps", type=int, default=64, help="steps of the loss run (0: skip it)")
    ap.add_argument("--smoke", action="store_true", help="tiny widths, 8 gloo processes on CPU")
    ap.add_argument("--only", nargs="+", choices=("dualpipev", "dualpipev-no-overlap", "1f1b", "dualpipev-loss"),
                    help="only these of the runs above, in their order")
    args = ap.parse_args()
    overlap_on = ["parallel.pp_schedule=dualpipev", "parallel.pp_overlap=true"]
    runs = [("dualpipev", overlap_on, args.steps),
            ("dualpipev-no-overlap", ["parallel.pp_schedule=dualpipev", "parallel.pp_overlap=false"], args.steps),
            ("1f1b", ["parallel.pp_schedule=1f1b"], args.steps)]
    if args.loss_steps:
        runs.append(("dualpipev-loss", overlap_on, args.loss_steps))
    if args.only and "dualpipev-loss" in args.only and not args.loss_steps:
        ap.error("--only dualpipev-loss: --loss-steps is 0 (it skips that run)")
    runs = [r for r in runs if args.only is None or r[0] in args.only]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    log = open(Path(args.out) / "log.txt", "w")
    rows, ok = [], True
    for name, overrides, steps in runs:
        print(f"paper_config: {name}: {steps} steps ...", flush=True)
        run_dir = Path(args.out) / "runs" / name
        recs = launch(name, ["deepseek-v2-lite", *LAYOUT, *(SMOKE if args.smoke else []), *overrides,
                             f"train.steps={steps}"], 8, run_dir, log)
        if recs is None:
            print(f"paper_config: {name} FAILED; see {args.out}/log.txt", flush=True)
            rows.append({"run": name, "failed": True})
            ok = False
            continue
        n, as_labelled = overlap_as_labelled(run_dir, "parallel.pp_overlap=true" in overrides)
        rows.append({**summary(name, recs), "predicted_per_gpu": prediction(overrides, args.smoke),
                     "overlapped_all_to_all_per_rank": n})
        if not as_labelled:
            print(f"paper_config: {name}: overlapped all-to-all phases per rank {n}: not what the label says",
                  flush=True)
        loss_fell = name != "dualpipev-loss" or rows[-1]["finite"] and rows[-1]["loss_last"] < rows[-1]["loss_first"]
        ok &= as_labelled and loss_fell  # and the loss run's loss must fall and stay finite
    (Path(args.out) / "paper.json").write_text(json.dumps({"smoke": args.smoke, "runs": rows}, indent=1))
    print("| run | steps | tokens/s | tokens/s/GPU | predicted/GPU (ratio) | MFU | peak GB per rank | "
          "loss first -> last |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r.get("failed"):
            print(f"| {r['run']} | FAILED (log.txt) | | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        mem = ", ".join(f"{m:.1f}" for m in r["peak_mem_gb_per_rank"] or [])
        pred = (f"{r['predicted_per_gpu']:.0f} ({r['predicted_per_gpu'] / r['tokens_per_s_per_gpu']:.2f})"
                if r["predicted_per_gpu"] else "n/a")
        print(f"| {r['run']} | {r['steps']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_per_gpu']:.0f} | {pred} | "
              f"{mfu} | {mem} | {r['loss_first']:.3f} -> {r['loss_last']:.3f}"
              f"{'' if r['finite'] else ' (non-finite)'} |")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
