"""Model FLOPs, MFU, parameter counts and the step log (one human line + one JSON line per report)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

# Dense bf16 datasheet peaks (TFLOP/s) used as the MFU denominator (../shared/BENCH.md).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "B200": 2250.0, "B300": 2250.0}


def matmul_params(model_cfg) -> tuple[int, int]:
    """(total, touched per token) matmul parameters: every layer's (from the family config) plus
    the LM head. The embedding lookup is no matmul and is excluded."""
    total = active = model_cfg.vocab_size * model_cfg.hidden_size
    for i in range(model_cfg.num_layers):
        t, a = model_cfg.layer_params(i)
        total, active = total + t, active + a
    return total, active


def flops_per_token(model_cfg, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the MFU numerator of BENCH.md:

        6 * (matmul parameters touched per token, LM head included, embedding excluded)
        + sum over layers of 3 * keys_seen * (d_qk + d_v) * n_heads

    keys_seen = seq_len for causal full attention (the causal half of 2 * seq_len) and
    2 * window for a sliding window shorter than the sequence. Routed experts count top_k
    experts, shared experts in full, routers count.
    """
    _, active = matmul_params(model_cfg)
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
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, v in PEAK_TFLOPS.items():
        if key in name:
            return v
    return None


class StepLog:
    """Prints `step  loss  lr  grad-norm  tok/s  MFU  mem  imbalance` and appends the record (with
    the per-layer expert load and routing statistics, reductions.routing_metrics) to
    <run_dir>/metrics.jsonl. Only rank 0 writes. The file continues from the step the run
    starts at: records of later steps (a run that went on past its last checkpoint, or one set
    aside by --no-resume) move to metrics.abandoned.jsonl, so each step appears once."""

    def __init__(self, run_dir: str | Path, start_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.t_last = time.perf_counter()
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._continue_from(start_step)

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

    def tick(self) -> float:
        now = time.perf_counter()
        dt, self.t_last = now - self.t_last, now
        return dt

    def write(self, rec: dict):
        if not self.enabled:
            return
        mfu = f"{100 * rec['mfu']:5.1f}%" if rec.get("mfu") is not None else "   n/a"
        mem = f"{rec['mem_gb']:6.2f}GB" if rec.get("mem_gb") is not None else "     -"
        print(f"step {rec['step']:6d} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
              f"gnorm {rec['grad_norm']:6.3f} | {rec['tokens_per_s']:9.0f} tok/s | MFU {mfu} | "
              f"mem {mem} | imbalance {rec['imbalance']:.2f}", flush=True)
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")


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
