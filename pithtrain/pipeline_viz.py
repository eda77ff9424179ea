"""Draw a pipeline run's timeline: one row per rank, one box per op, the gaps are the bubbles.

    python -m pithtrain.pipeline_viz RUN_DIR            # RUN_DIR/pipeline_timeline/rank*.json
    python -m pithtrain.pipeline_viz RUN_DIR --width 120
    python -m pithtrain.pipeline_viz RECIPE [k=v ...]   # the recipe's log.run_dir
    invoke profile --pipeline --recipe RECIPE

A pipeline run (parallel.pp > 1) records the op start/end times of its last step on every rank,
and every phase it ran (pithtrain/distributed/pipeline.py: run_step; overlap.py's timeline). This
writes RUN_DIR/pipeline_timeline/timeline.png (matplotlib, from the dev extra; skipped with a note
when it is missing) and prints a text version: one character per time slot, the op kind's letter
(F forward, B input-backward, W weight-backward, X full backward, O overlapped forward+backward),
'.' for idle, then each rank's idle fraction. Above each rank's row, its communication phases
(expert all-to-all dispatch / combine): '^' where one ran (in the PNG a thin lane above the ops,
so an all-to-all drawn over a compute op is one that ran under it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

LETTER = {"F": "F", "B": "B", "W": "W", "BW": "X", "FB": "O"}
COLOR = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b", "BW": "#e45756", "FB": "#b279a2", "comm": "#222222"}


def load(run_dir: str | Path) -> list[dict]:
    d = Path(run_dir) / "pipeline_timeline"
    files = sorted(d.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if not files:
        raise FileNotFoundError(f"{d}: no rank*.json (run with parallel.pp > 1 first)")
    return [json.loads(p.read_text()) for p in files]


def comm_phases(rank: dict) -> list[dict]:
    return [p for p in rank.get("phases", ()) if p["comm"]]


def overlapped(rank: dict) -> int:
    """How many of the rank's communication phases were issued in one F&B pairing step with a
    compute phase of the other micro-batch (overlap.forward_backward), i.e. ran under it."""
    phases = rank.get("phases", ())
    n = 0
    for e in comm_phases(rank):
        partner = [o for o in phases if o is not e and o["op"] == e["op"] and o["pair"] == e["pair"]]
        n += e["pair"] is not None and len(partner) == 1 and not partner[0]["comm"] and partner[0]["mb"] != e["mb"]
    return n


def lane(spans: list[dict], end: float, width: int, blank: str, mark) -> str:
    """`width` slots of [0, end): each span's slots (at least one) marked with mark(span)."""
    row = [blank] * width
    for s in spans:
        a = int(s["start"] / end * width)
        for i in range(a, min(max(a + 1, int(s["end"] / end * width)), width)):
            row[i] = mark(s)
    return "".join(row)


def text(ranks: list[dict], width: int = 100) -> str:
    end = max(op["end"] for r in ranks for op in r["ops"])
    lines = [f"step {ranks[0]['step']}: {end * 1e3:.1f} ms, {width} slots of {end / width * 1e3:.2f} ms"]
    for r in ranks:
        idle = 1 - sum(op["end"] - op["start"] for op in r["ops"]) / end
        row = lane(r["ops"], end, width, ".", lambda op: LETTER.get(op["kind"], "?"))
        comm = lane(comm_phases(r), end, width, " ", lambda ph: "^")
        if "^" in comm:
            lines.append(f"{'  all-to-all':<16} |{comm}|")
        lines.append(f"rank {r['rank']:>3} (pp {r['pp_rank']}) |{row}| idle {idle:.0%}"
                     + (f", {overlapped(r)} all-to-all overlapped" if comm_phases(r) else ""))
    lines.append("F forward  B input-backward  W weight-backward  X full backward  "
                 "O forward+backward overlapped  . idle  ^ all-to-all (dispatch / combine)")
    return "\n".join(lines)


def png(ranks: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.5 * len(ranks)))
    for y, r in enumerate(ranks):
        for op in r["ops"]:
            ax.barh(y + 0.1, (op["end"] - op["start"]) * 1e3, left=op["start"] * 1e3, height=0.6,
                    color=COLOR.get(op["kind"], "grey"), edgecolor="white", linewidth=0.3)
        for ph in comm_phases(r):  # communication lane, above the compute ops of the same rank
            ax.barh(y - 0.32, (ph["end"] - ph["start"]) * 1e3, left=ph["start"] * 1e3, height=0.16,
                    color=COLOR["comm"], linewidth=0)
    ax.set_yticks(range(len(ranks)), [f"rank {r['rank']}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step started")
    ax.set_title(f"pipeline timeline, step {ranks[0]['step']}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOR.values()]
    fig.legend(handles, ["F", "B", "W", "B+W", "F+B overlapped", "all-to-all (above)"], loc="lower center",
               fontsize=7, ncol=6)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run_directory(args: list[str]) -> Path:
    """A directory argument is the run directory; otherwise recipe + overrides name it."""
    if len(args) == 1 and Path(args[0]).is_dir():
        return Path(args[0])
    from pithtrain.config import load_config
    recipe, overrides = (args[0], args[1:]) if args and "=" not in args[0] else (None, args)
    return Path(load_config(recipe, overrides).log.run_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pithtrain.pipeline_viz", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", nargs="*", help="a run directory, or a recipe and overrides (its log.run_dir)")
    p.add_argument("--width", type=int, default=100, help="characters per rank in the text version")
    args = p.parse_args(argv)
    try:
        run_dir = run_directory(args.run)
        ranks = load(run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text(ranks, args.width))
    out = Path(run_dir) / "pipeline_timeline" / "timeline.png"
    print(f"wrote {out}" if png(ranks, out) else "matplotlib not installed: no PNG (pip install -e '.[dev]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
