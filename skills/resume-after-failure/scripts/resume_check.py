"""Resume after a failure: what a restart will load, and a drill proving resume is exact. PASS or FAIL.

    python skills/resume-after-failure/scripts/resume_check.py --run-dir runs/my-run   # inspect a real run
    python skills/resume-after-failure/scripts/resume_check.py                         # crash drill (tiny, CPU)
    python skills/resume-after-failure/scripts/resume_check.py --nproc 2               # drill with FSDP over 2 ranks

--run-dir: lists the run's checkpoints newest first with their verification result (manifest sizes
and sha256, pithtrain/checkpoint/dcp.py) and names the one an automatic restart resumes from.
PASS: there is one. Nothing is modified.

Drill (default): A trains 6 steps straight (checkpoint every 2). B trains the same recipe but is
killed while committing step 4 (PITHTRAIN_TEST_CRASH_IN_SAVE=4: shards written, nothing committed),
then restarted with the identical command. A and B's first run go side by side. PASS: B's first run
dies, the restart exits 0 and says it resumed from step_2, every logged step of B equals A's loss
exactly, and the final weights are bitwise equal. The two run dirs go under --out (kept; inspect
them with --run-dir), by default a temporary folder that is printed and removed at the end.
Exit status 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

TINY = ["train.micro_batch_size=4", "train.seq_len=64", "train.warmup_steps=2", "model.hidden_size=64",
        "model.num_heads=4", "model.head_dim=16", "model.moe_intermediate_size=64", "model.num_layers=2",
        "data.max_bytes=300000", "train.device=cpu", "train.steps=6", "checkpoint.every=2",
        "checkpoint.keep_last=3", "log.every=1"]
CRASH_STEP, RESUME_STEP = 4, 2


# ---------------------------------------------------------------------------------------------
# Inspect a run dir


def inspect(run_dir: Path) -> int:
    from pithtrain.checkpoint.dcp import CheckpointError, checkpoints_dir, find_resumable, step_dirs, verify

    root = checkpoints_dir(run_dir)
    print(f"checkpoints in {root}:")
    for c in step_dirs(root):
        try:
            verify(c)
            state = "valid"
        except CheckpointError as e:
            state = f"damaged: {e}"
        print(f"  {c.name:<12} {state}")
    found, notes = find_resumable(root)
    for n in notes:
        print(f"  note: {n}")
    if found is None:
        print("an automatic restart has nothing to resume from (it starts fresh, or stops if damaged "
              "checkpoints exist: see the notes)\nFAIL")
        return 1
    trainer = json.loads((found / "trainer.json").read_text())
    print(f"an automatic restart resumes from {found} (step {trainer['step']}, "
          f"saved {trainer.get('saved_at', '?')}, world size {trainer.get('world_size', '?')})\nPASS")
    return 0


# ---------------------------------------------------------------------------------------------
# The crash drill


def start(run_dir: Path, nproc: int, crash: int | None = None) -> subprocess.Popen:
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                    "--standalone", f"--nproc-per-node={nproc}"]
    layout = [] if nproc == 1 else [f"parallel.fsdp={nproc}"]
    cmd = launcher + ["-m", "pithtrain.train", *TINY, *layout, f"log.run_dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("PITHTRAIN_TEST_CRASH_IN_SAVE", None)
    if crash is not None:
        env["PITHTRAIN_TEST_CRASH_IN_SAVE"] = str(crash)
    print("+ " + ("PITHTRAIN_TEST_CRASH_IN_SAVE=%d " % crash if crash else "") + " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, what: str) -> tuple[int, str]:
    """Wait for a run; print its checkpoint and error lines; (exit status, output)."""
    out = proc.communicate()[0]
    print(f"  {what} (exit {proc.returncode}):")
    print("\n".join("    " + ln for ln in out.splitlines()
                    if "checkpoint" in ln or "error" in ln.lower() or "Traceback" in ln), flush=True)
    return proc.returncode, out


def logged(run_dir: Path) -> list[tuple[int, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines()) if r]


def final_weights(ckpt: Path):
    import torch

    from pithtrain.checkpoint.dcp import load_model_weights
    from pithtrain.config import load_config
    from pithtrain.models import build_model

    cfg = load_config(None, TINY)
    model = build_model(cfg.model, "cpu")
    load_model_weights(ckpt, model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, torch.equal


def drill(nproc: int, out: Path | None) -> int:
    with contextlib.ExitStack() as stack:
        if out is None:
            out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pithtrain-resume-")))
            print(f"drill runs in {out} (temporary: removed at the end; --out DIR keeps them)")
        else:
            print(f"drill runs in {out}/A and {out}/B")
        return check_drill(out / "A", out / "B", nproc)


def check_drill(a: Path, b: Path, nproc: int) -> int:
    problems = []
    runs = start(a, nproc), start(b, nproc, crash=CRASH_STEP)  # side by side: independent run dirs
    (ra, _), (rb1, _) = finish(runs[0], "A, uninterrupted"), finish(runs[1], f"B, killed saving step {CRASH_STEP}")
    if ra != 0:
        problems.append(f"the uninterrupted run failed (exit {ra})")
    if rb1 == 0:
        problems.append("the crash hook did not fire (run B finished)")
    rb2, out = finish(start(b, nproc), "B, restarted")
    if rb2 != 0:
        problems.append(f"the restart failed (exit {rb2})")
    if f"step_{RESUME_STEP}" not in out or "resumed from" not in out:
        problems.append(f"the restart did not say it resumed from step_{RESUME_STEP}")
    ref = dict(logged(a))
    steps = {s for s, _ in logged(b)}
    diffs = [(s, loss, ref.get(s)) for s, loss in logged(b) if ref.get(s) != loss]
    if not ref or steps != set(ref):
        problems.append(f"logged steps differ: A {sorted(ref)}, B {sorted(steps)}")
    for s, lb, la in diffs[:5]:
        problems.append(f"step {s}: resumed loss {lb!r} != uninterrupted {la!r}")
    print(f"  losses compared: {len(logged(b))} records of B against A, {len(diffs)} differ")
    last = f"checkpoints/step_{ref and max(ref) or 0}"
    if not problems:
        wa, equal = final_weights(a / last)
        wb, _ = final_weights(b / last)
        bad = [k for k in wa if not equal(wa[k], wb[k])]
        print(f"  final weights compared: {len(wa)} tensors, {len(bad)} differ")
        problems += [f"final weight {k} differs" for k in bad[:5]]
    for p in problems:
        print(f"problem: {p}")
    print("FAIL" if problems else "PASS")
    return 1 if problems else 0


# ---------------------------------------------------------------------------------------------
# Entry point


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", type=Path, help="inspect this run's checkpoints instead of running the drill")
    p.add_argument("--nproc", type=int, default=1, help="processes for the drill (FSDP over them; gloo on CPU)")
    p.add_argument("--out", type=Path, help="folder for the drill's run dirs A and B, kept (default: a temporary one)")
    args = p.parse_args(argv)
    if args.run_dir:
        return inspect(args.run_dir)
    return drill(args.nproc, args.out)


if __name__ == "__main__":
    sys.exit(main())
