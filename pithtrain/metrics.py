"""Model FLOPs, MFU, parameter counts, the step log (one human line + one JSON line per report, plus
TensorBoard / W&B) and the run's curves as one PNG:

    python -m pithtrain.metrics RUN_DIR          # RUN_DIR/metrics.png (`invoke plot RUN_DIR`)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from pithtrain.gpus import GPUS, gpu_key


def matmul_params(model_cfg) -> tuple[int, int]:
    """(total, touched per token) matmul parameters: every layer's (from the family config) plus
    the LM head. The embedding lookup is no matmul and is excluded."""
    head = model_cfg.vocab_size * model_cfg.hidden_size
    layers = [model_cfg.layer_params(i) for i in range(model_cfg.num_layers)]
    return head + sum(t for t, _ in layers), head + sum(a for _, a in layers)


def flops_per_token(model_cfg, seq_len: int, computed_slots: float | None = None) -> float:
    """Training FLOPs per token (forward + backward), the MFU numerator of docs/bench.md:

        6 * (matmul parameters touched per token, LM head included, embedding excluded)
        + sum over layers of 3 * keys_seen * (d_qk + d_v) * n_heads

    keys_seen = seq_len for causal full attention (the causal half of 2 * seq_len) and
    2 * window for a sliding window shorter than the sequence. Routed experts count top_k
    experts, shared experts in full, routers count. `computed_slots`: where the routing decides
    the compute (a router that drops slots), the routed-expert slots a MoE layer computed per
    token in the step (its `computed_slots_per_token` metric) count instead of top_k.
    """
    _, active = matmul_params(model_cfg)
    if computed_slots is not None and model_cfg.num_experts > model_cfg.top_k:
        # one expert's parameters: the layer's untouched ones per expert
        for total, touched in map(model_cfg.layer_params, range(model_cfg.num_layers)):
            active += (computed_slots - model_cfg.top_k) * (total - touched) / (model_cfg.num_experts - model_cfg.top_k)
    attn = 0
    for i in range(model_cfg.num_layers):
        window, d_qk, d_v, heads = model_cfg.attention_shapes(i)
        keys = 2 * window if window is not None and window < seq_len else seq_len
        attn += 3 * keys * (d_qk + d_v) * heads
    return 6 * active + attn


def param_counts(model: torch.nn.Module, model_cfg) -> tuple[int, int]:
    """(total, active per token) parameters, embeddings and norms included, as model cards count
    them: active = total - the routed experts a token does not visit. A family whose card leaves
    the embedding lookup out of "active" (GPT-OSS) says so with `active_counts_embedding = False`.
    Pass the whole model (a meta-device build is enough): a pipeline stage holds only its part."""
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    mm_total, mm_active = matmul_params(model_cfg)
    active = total - (mm_total - mm_active)
    if not getattr(model_cfg, "active_counts_embedding", True):
        active -= model_cfg.vocab_size * model_cfg.hidden_size
    return total, active


def peak_tflops(device: torch.device, override: float = 0.0) -> float | None:
    """MFU's denominator: log.peak_tflops when set, else the GPU's dense bf16 datasheet peak
    (pithtrain/gpus.py; docs/bench.md); None on CPU or an unknown GPU."""
    if override > 0:
        return override
    key = gpu_key(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return GPUS[key].peak_tflops if key else None


class StartupTimer:
    """A start-up step's line, `pithtrain: <name>: 1.2s` when it is done (`announce`: also a line
    when it starts, for steps that can take minutes). Use as `with StartupTimer(...)` or call .done()."""

    def __init__(self, name: str, enabled: bool = True, announce: bool = False):
        self.name, self.enabled, self.t0 = name, enabled, time.perf_counter()
        if enabled and announce:
            print(f"pithtrain: {name} ...", flush=True)

    def done(self):
        if self.enabled:
            print(f"pithtrain: {self.name}: {time.perf_counter() - self.t0:.1f}s", flush=True)
            self.enabled = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.done()


class StepLog:
    """Prints `step  loss  lr  grad-norm  tok/s  MFU  mem  imbalance  ETA` and appends the same
    record (with the per-layer expert load and routing statistics, reductions.routing_metrics)
    to <run_dir>/metrics.jsonl, and to TensorBoard (<run_dir>/tensorboard) and Weights &
    Biases when the recipe's log section asks. Only rank 0 writes. The file continues from the step
    the run starts at: records of later steps (a run that went on past its last checkpoint, or one
    set aside by --no-resume) move to metrics.abandoned.jsonl, so each step appears once; the
    TensorBoard events are rewritten from what metrics.jsonl keeps, so the same holds for them."""

    def __init__(self, run_dir: str | Path, start_step: int = 0, enabled: bool = True,
                 total_steps: int | None = None, cfg=None):
        self.enabled, self.total_steps = enabled, total_steps
        self.path = Path(run_dir) / "metrics.jsonl"
        self.t_last = self.t_eta = time.perf_counter()
        self.step_eta = start_step
        self.tb = self.wandb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._continue_from(start_step)
            if cfg is not None and cfg.log.tensorboard:
                self.tb = self._open_tensorboard()
            if cfg is not None and cfg.log.wandb:
                self.wandb = self._open_wandb(cfg)

    def _open_tensorboard(self):
        from torch.utils.tensorboard import SummaryWriter  # log.tensorboard: config checks it is installed

        tb_dir = self.path.parent / "tensorboard"
        for f in tb_dir.glob("events.out.tfevents.*"):  # derived from metrics.jsonl: rebuilt below
            f.unlink()
        writer = SummaryWriter(str(tb_dir))
        for line in self.path.read_text().splitlines() if self.path.is_file() else ():
            _add_scalars(writer, json.loads(line))
        writer.flush()
        return writer

    def _open_wandb(self, cfg):
        import wandb  # log.wandb: config checks it is installed

        id_file = self.path.parent / "wandb_id"  # one W&B run per run directory, resumed with it
        if not id_file.is_file():
            id_file.write_text(wandb.util.generate_id())
        return wandb.init(project=cfg.log.wandb, id=id_file.read_text().strip(), resume="allow",
                          dir=str(self.path.parent), config=cfg.to_dict())

    def _continue_from(self, start_step: int):
        if not self.path.is_file():
            return
        keep, drop = [], []
        for line in self.path.read_text().splitlines(keepends=True):
            try:
                ok = json.loads(line)["step"] <= start_step
            except (ValueError, KeyError, TypeError):  # a line cut short by a crash
                ok = False
            (keep if ok else drop).append(line if line.endswith("\n") else line + "\n")
        if not drop:
            return
        with self.path.with_name("metrics.abandoned.jsonl").open("a") as f:
            f.writelines(drop)
        tmp = self.path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, self.path)
        print(f"pithtrain: {len(drop)} metrics record(s) after step {start_step} moved to "
              "metrics.abandoned.jsonl (this run starts there)", flush=True)

    @contextlib.contextmanager
    def excluded(self):
        """Time spent inside is left out of the next tick's interval (the ETA still counts it)."""
        t0 = time.perf_counter()
        yield
        self.t_last += time.perf_counter() - t0

    def tick(self) -> float:
        now = time.perf_counter()
        dt, self.t_last = now - self.t_last, now
        return dt

    def write(self, rec: dict):
        if not self.enabled:
            return
        mfu = f"{100 * rec['mfu']:5.1f}%" if rec.get("mfu") is not None else "   n/a"
        mem = f"{rec['mem_gb']:6.2f}GB" if rec.get("mem_gb") is not None else "     -"
        val = f"val {rec['val_loss']:.4f} | " if "val_loss" in rec else ""
        now, step = time.perf_counter(), rec["step"]
        eta = (now - self.t_eta) / max(step - self.step_eta, 1) * ((self.total_steps or step) - step)
        self.t_eta, self.step_eta = now, step
        print(f"step {step:6d} | loss {rec['loss']:.4f} | {val}lr {rec['lr']:.2e} | "
              f"gnorm {rec['grad_norm']:6.3f} | {rec['tokens_per_s']:9.0f} tok/s | MFU {mfu} | "
              f"mem {mem} | imbalance {rec['imbalance']:.2f} | ETA {_duration(eta)}", flush=True)
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            _add_scalars(self.tb, rec)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in rec.items() if k != "step"}, step=step)

    def close(self):
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _add_scalars(writer, rec: dict):
    for k, v in rec.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
            writer.add_scalar(k, v, rec["step"])


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


def memory_gb(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB
    except ImportError:
        return None


def check_finite(step: int, **values: float):
    """Raise before the optimizer step if the loss or gradient norm is not finite, so neither the
    weights nor any checkpoint ever holds what a diverged step would write."""
    bad = ", ".join(f"{k} {v}" for k, v in values.items() if not math.isfinite(v))
    if bad:
        raise FloatingPointError(f"step {step}: {bad}; stopped before the update (the weights and "
                                 "the last checkpoint are finite); lower train.lr, or check the data")


# ---------------------------------------------------------------------------------------------
# The run's curves as one picture (`invoke plot RUN_DIR`)

PANELS = (("loss", "training loss"), ("val_loss", "validation loss"), ("tokens_per_s", "tokens / s"),
          ("imbalance", "expert load: max / mean tokens per expert"))


def plot_run(run_dir: str | Path, out: str | Path | None = None):
    """Draw <run_dir>/metrics.jsonl as one PNG (default <run_dir>/metrics.png) with the PANELS, each
    against the step; a metric never logged (no evaluation) gets an empty panel saying so.
    Returns the (closed) matplotlib Figure."""
    import matplotlib
    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics log (is {run_dir} a run directory?)")
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (key, title) in zip(axes.flat, PANELS):
        pts = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
        ax.plot([s for s, _ in pts], [v for _, v in pts], marker=".", label=key)
        ax.set(title=title, xlabel="step")
        if not pts:
            ax.text(0.5, 0.5, f"no {key} in the log", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    fig.savefig(out or Path(run_dir) / "metrics.png", dpi=100)
    plt.close(fig)
    return fig


def main(argv: list[str] | None = None) -> int:
    """python -m pithtrain.metrics RUN_DIR [--out PNG]: the run's curves as one PNG."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m pithtrain.metrics", description=main.__doc__)
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="PNG to write (default: RUN_DIR/metrics.png)")
    args = p.parse_args(argv)
    try:
        plot_run(args.run_dir, args.out)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"plot: wrote {args.out or Path(args.run_dir) / 'metrics.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
