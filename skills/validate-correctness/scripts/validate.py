"""Validate a change: the evidence every change to PithTrain must produce. Prints PASS or FAIL.

    python skills/validate-correctness/scripts/validate.py --quick                # CI subset (~1 min, 2 cores)
    python skills/validate-correctness/scripts/validate.py                        # every check this tree has
    python skills/validate-correctness/scripts/validate.py --family gpt_oss       # parity for one family
    python skills/validate-correctness/scripts/validate.py --changed-since main   # families the diff touches
    python skills/validate-correctness/scripts/validate.py --quick --fail-fast    # stop at the first FAIL
    python skills/validate-correctness/scripts/validate.py --family qwen3_moe --set model.top_k=1  # a switch on
    python skills/validate-correctness/scripts/validate.py --set model.top_k=1 -k pp2   # rerun matching tests

Checks, in order; each is PASS, FAIL or SKIP (with the reason); the verdict is FAIL if any check fails:
  parity <family>  tests/test_<family>.py against transformers (--quick: only *match_transformers tests)
  moe              tests/test_moe.py: grouped matmul == per-expert loop, forward and backward
  training <fam>   a fixed 30-step run of a tiny model of the first family checked (plus --set
                   overrides): every loss finite and mean(last 3) < mean(first 3) - 1.0
                   (CPU fp32, seeded: the same verdict every time)
  distributed      tests/test_distributed.py, test_pipeline*.py, test_overlap.py: every parallel
                   layout equals one process (skipped with --quick)
  resume           tests/test_checkpoint*.py: a resumed run equals the uninterrupted one (skipped
                   with --quick)

--set model.X=V turns a variant's switch on in the training run and, through PITHTRAIN_TEST_SET
(tests/variant.py), in the distributed and resume tests whose config admits it: the config with
the switch on must pass the family's own checks (the field exists there, `validate` accepts it;
e.g. a switch that needs an even num_kv_heads is refused by a config with one), and a test whose
config refuses it runs with the switch off. Each check's line names the tests that took it and
those that ran with it off, with the config's reason; a check none of whose tests took it FAILs.
Parity and moe run without it: transformers and the bare experts have no such switch.
-k EXPR keeps, in every pytest check, only the tests matching it (a check with none SKIPs): rerun
a failing test with the switch on. A failing check prints each failing test's name and its
assertion lines (pytest's E lines, from its JUnit report) to stderr.
Everything it writes (the training run, pytest's tmp_path, TMPDIR) goes under --out (default
<root>/runs/validate/<time>), printed at the start.

It validates the tree it lives in (imports <root>/pithtrain, runs <root>/tests), so a patched copy of
the repository validates itself: tests/test_skills.py plants a bug in a copy and expects FAIL.
Exit status: 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

# Which test files hold which evidence (globs under tests/; tools/skills.py lint: each matches a file).
DISTRIBUTED_TESTS = ("test_distributed.py", "test_pipeline*.py", "test_overlap.py")
RESUME_TESTS = ("test_checkpoint*.py",)
# Files whose change touches every family (shared blocks, the family table, HF import/export).
SHARED_MODEL_FILES = ("pithtrain/models/common.py", "pithtrain/models/__init__.py", "pithtrain/checkpoint/hf.py")
# The fixed short run: every family's config defaults are already tiny; narrower and shallower here.
TINY_RUN = {"train": {"steps": 30, "micro_batch_size": 4, "seq_len": 64, "warmup_steps": 5, "device": "cpu",
                      "seed": 1234},
            "data": {"max_bytes": 300000}, "checkpoint": {"final": False}, "log": {"every": 10}}
TINY_MODEL = {"hidden_size": 64, "num_layers": 2}
MARGIN = 1.0  # nats the loss must fall between the first and last three steps


# ---------------------------------------------------------------------------------------------
# Checks: each returns (verdict, detail) with verdict in PASS / FAIL / SKIP


def pytest(files: list[Path], out: Path, k: str | None = None, sets: list[str] = (),
           subset: bool = False) -> tuple[str, str]:
    """pytest on `files`, writing under `out`; with `sets` (model.X=V), the tests that took them and
    those whose config refused them are named. `subset`: `k` is the user's -k, and a check none
    of whose tests match it is a SKIP."""
    if not files:
        return "FAIL", "no such test files in this tree"
    (out / "tmp").mkdir(parents=True, exist_ok=True)
    log, report = out / "set-applied.txt", out / "junit.xml"
    log.unlink(missing_ok=True)
    report.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--basetemp={out / 'pytest'}",
           f"--junitxml={report}", *map(str, files)]
    if k:
        cmd += ["-k", k]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TMPDIR": str(out / "tmp"), "PITHTRAIN_TEST_SET": "\n".join(sets), "PITHTRAIN_TEST_SET_LOG": str(log)}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    counts = [ln for ln in lines if re.search(r"\d+ (passed|failed|error|skipped|deselected)", ln)]
    summary = (counts or lines or ["(no output)"])[-1].strip("= ")
    names = ", ".join(f.name for f in files)
    took, off = switch_log(log)
    if sets:
        summary += switch_report(sets, took, off)
    if r.returncode == 5:
        return ("SKIP", f"{names}: no test matches -k {k}") if subset else \
               ("FAIL", f"{names}: no test selected ({k or 'all'})")
    if r.returncode == 0 and sets and not took:
        why = "every config refused it (above)" if off else "none builds its config through tests/variant.py"
        return "FAIL", f"{names}: {summary}\n{INDENT}FAIL: {' '.join(sets)} reached none of these tests: {why}"
    if r.returncode == 0:
        return "PASS", f"{names}: {summary}"
    print(failures(report) or "\n".join(lines[-40:] + [r.stderr[-2000:]]), file=sys.stderr)
    return "FAIL", f"{names}: {summary}"


INDENT = " " * 39  # the table's detail column


def switch_log(log: Path) -> tuple[list[str], dict[str, str]]:
    """tests/variant.py's log: the tests that took the switch, and test -> why for those whose
    config refused it (ran with it off)."""
    took, off = set(), {}
    for line in (log.read_text().splitlines() if log.is_file() else []):
        outcome, test, *why = line.split("\t")
        if outcome == "took":
            took.add(test)
        else:
            off.setdefault(test, why[0] if why else "?")
    return sorted(took), off


def switch_report(sets: list[str], took: list[str], off: dict[str, str]) -> str:
    """The tests that ran with the switch, then those that ran with it off, grouped by the reason."""
    text = f"; with {' '.join(sets)}: {len(took)} tests took it, {len(off)} ran with it off"
    text += "".join(f"\n{INDENT}took: {t}" for t in took)
    for why in sorted(set(off.values())):
        text += f"\n{INDENT}off (their config refuses it: {why}):"
        text += "".join(f"\n{INDENT}  {t}" for t, w in sorted(off.items()) if w == why)
    return text


def failures(report: Path, most: int = 30) -> str:
    """Each failing test's name and its assertion lines (pytest's `E` lines, the last `most`, and
    where it failed), from pytest's JUnit XML; "" when there is none to read."""
    import xml.etree.ElementTree as ET
    try:
        cases = ET.parse(report).getroot().iter("testcase")
    except (OSError, ET.ParseError):
        return ""
    out = []
    for case in cases:
        for bad in [c for c in case if c.tag in ("failure", "error")]:
            text = (bad.text or bad.get("message") or "").splitlines()
            said = [ln for ln in text if ln.startswith("E ")][-most:] or [bad.get("message", "")]
            where = [ln for ln in text if re.match(r"\S+\.py:\d+: \w", ln)][-1:]
            out += [f"FAILED {case.get('classname')}::{case.get('name')} ({bad.tag})", *said, *where, ""]
    return "\n".join(out)


def training(family: str, overrides: list[str], out: Path) -> tuple[str, str]:
    import yaml

    from pithtrain.config import load_config
    from pithtrain.train import train

    out.mkdir(parents=True, exist_ok=True)
    recipe = out / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"family": family, **TINY_MODEL}, **TINY_RUN}))
    try:
        hist, _ = train(load_config(recipe, [f"log.run_dir={out}/run", *overrides]), resume=False)
    except Exception as e:  # a bad override or a non-finite loss: a FAIL, not a crash
        return "FAIL", f"training raised {type(e).__name__}: {e}"
    losses = [h["loss"] for h in hist]
    if not all(math.isfinite(v) for v in losses + [h["grad_norm"] for h in hist]):
        return "FAIL", "a loss or gradient norm is not finite"
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    detail = f"loss {first:.3f} -> {last:.3f} over {len(losses)} steps (needs a fall > {MARGIN})"
    return ("PASS" if last < first - MARGIN else "FAIL"), detail


def changed_families(ref: str, families: list[str]) -> list[str]:
    diff = subprocess.run(["git", "diff", "--name-only", ref], cwd=ROOT, capture_output=True, text=True)
    new = subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True)
    if diff.returncode != 0:
        sys.exit(f"error: git diff {ref}: {diff.stderr.strip()}")
    paths = set(diff.stdout.split()) | set(new.stdout.split())
    if paths & set(SHARED_MODEL_FILES):
        return families
    touched = [f for f in families if f"pithtrain/models/{f}.py" in paths or f"tests/test_{f}.py" in paths]
    return touched or families[:1]  # nothing model-specific: still check the default family


def glob_tests(patterns) -> list[Path]:
    return sorted({p for pat in patterns for p in (ROOT / "tests").glob(pat)})


# ---------------------------------------------------------------------------------------------
# Entry point


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the CI subset: parity of one family, moe, training")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failing check")
    p.add_argument("--family", action="append", default=[], help="family to check parity for (repeatable)")
    p.add_argument("--changed-since", metavar="REF", help="check the families touched since git REF")
    p.add_argument("--set", action="append", default=[], metavar="K=V",
                   help="a variant's switch, e.g. model.top_k=1 (repeatable): the training run takes every "
                        "override, the distributed and resume tests the model.* ones")
    p.add_argument("--out", type=Path, help="write everything here (default: <root>/runs/validate/<time>)")
    p.add_argument("-k", metavar="EXPR", help="only the tests matching this pytest -k expression, in every pytest "
                                              "check (none matching: SKIP); to rerun a failing test with --set")
    args = p.parse_args(argv)
    out = (args.out or ROOT / "runs" / "validate" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    sets = [s for s in args.set if s.startswith("model.")]
    (out / "tmp").mkdir(parents=True, exist_ok=True)
    os.environ["TMPDIR"] = tempfile.tempdir = str(out / "tmp")  # this process and every one it starts

    from pithtrain.models import FAMILIES

    known = list(FAMILIES)
    families = args.family or (changed_families(args.changed_since, known) if args.changed_since
                               else known[:1] if args.quick else known)
    for f in families:
        if f not in FAMILIES:
            sys.exit(f"error: unknown family {f!r} (families: {', '.join(known)})")

    quick_k = (f"match_transformers and ({args.k})" if args.k else "match_transformers") if args.quick else args.k
    plan = [(f"parity {f}", lambda f=f: pytest(glob_tests([f"test_{f}.py"]), out / f"parity-{f}", quick_k,
                                               subset=bool(args.k)))
            for f in families]
    plan += [("moe", lambda: pytest(glob_tests(["test_moe.py"]), out / "moe", args.k, subset=bool(args.k))),
             (f"training {families[0]}", lambda: training(families[0], args.set, out / "training"))]
    if args.quick:
        plan += [(name, lambda: ("SKIP", "not run with --quick")) for name in ("distributed", "resume")]
    else:
        plan += [(name, lambda globs=globs, name=name: pytest(glob_tests(globs), out / name, args.k, sets,
                                                              subset=bool(args.k)))
                 for name, globs in (("distributed", DISTRIBUTED_TESTS), ("resume", RESUME_TESTS))]

    print(f"validate-correctness: {ROOT} | families {', '.join(families)}{' | --quick' if args.quick else ''}"
          f"{f' | -k {args.k} (a subset of the tests)' if args.k else ''} | writing under {out}", flush=True)
    if args.set:
        print(f"  --set {' '.join(args.set)}: in training {families[0]}"
              + ("" if args.quick or not sets else f"; {' '.join(sets)} in distributed and resume (tests named)")
              + f"; not in {', '.join(n for n, _ in plan if n.startswith(('parity', 'moe')))}", flush=True)
    rows = []
    for name, run in plan:
        t0 = time.perf_counter()
        verdict, detail = run()
        rows.append((name, verdict, time.perf_counter() - t0, detail))
        print(f"  {name:<22} {verdict:<4} {rows[-1][2]:6.1f}s  {detail}", flush=True)
        if verdict == "FAIL" and args.fail_fast:
            break
    ok = all(v != "FAIL" for _, v, _, _ in rows)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
