"""Measure the performance model's costs on one GPU (pithtrain/perf.py), and check the model's
one-GPU predictions against steps measured in the same call.

    python scripts/calibrate.py --models qwen3-30b-a3b      # one device call a model: pithtrain/costs_h200.json
    python scripts/calibrate.py --cpu --out /tmp/costs.json                        # tiny widths on CPU (a test)

Per model (its recipe at real widths, micro-batch 2 x 4096, bf16 compute):
  1. costs: a short model (Qwen3 2 MoE layers; DeepSeek its dense layer + 2 MoE; GPT-OSS a window and
     a full layer) on each path (perf.py: train, fsdp, fsdp_sharded, bench), 2 micro-batches a step,
     the real `train.train_step` with CUDA events at every layer boundary, forward and backward, and at
     every phase of the forward (no synchronisation: the events partition the GPU's timeline, idle
     included); median of --steps instrumented steps after 1 + --warmup;
  2. the experts phase alone at ep = 1, 2, 4, 8 (E / ep experts, T x top_k rows), bf16 and FP8;
  3. the balance of that routing over ep groups, and its deduplicated remote rows per token;
  4. checks: bench's step (bf16 parameters) at 4 and 12 layers, train.py's own and the FSDP paths at 4
     layers, each at 1 and 8 micro-batches, measured (median of --steps after --warmup) beside
     perf.predict from the costs of 1-3 only.
Merges each model's entry and checks into --out (date, commit, device, versions); the table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pithtrain import bench, kernels, perf
from pithtrain.build import build_run
from pithtrain.config import load_config
from pithtrain.distributed.parallel_dims import ParallelDims
from pithtrain.gpus import gpu_key
from pithtrain.models import build_model
from pithtrain.models.common import GroupedExperts, decoder_layers, use_kernels

CAL_LAYERS = {"qwen3_moe": 2, "deepseek_v2": 3, "gpt_oss": 2}
_TINY = "model.vocab_size=512 model.hidden_size=64 model.num_heads=4 model.num_experts=8 model.top_k=2".split()
TINY = {"qwen3_moe": _TINY + "model.num_kv_heads=2 model.head_dim=16 model.moe_intermediate_size=32".split(),
        "deepseek_v2": _TINY + ("model.kv_lora_rank=16 model.qk_nope_head_dim=16 model.qk_rope_head_dim=8 "
                                "model.v_head_dim=16 "
                                "model.intermediate_size=64 model.moe_intermediate_size=32").split(),
        "gpt_oss": _TINY + ("model.num_kv_heads=2 model.head_dim=16 model.intermediate_size=32 "
                            "model.sliding_window=16").split()}


class Marks:
    """Points on the device's timeline: CUDA events (no synchronisation), the host clock on CPU."""

    def __init__(self, device):
        self.cuda, self.points = device.type == "cuda", []

    def __call__(self, key):
        if self.cuda:
            (ev := torch.cuda.Event(enable_timing=True)).record()
        self.points.append((key, ev if self.cuda else time.perf_counter()))

    def steps(self, step, accum: int, n: int) -> list[list[tuple]]:
        """n calls of step(accum), each one's points (between ("step",) and ("end",) those that
        `step` marks itself) as (key, seconds from its start)."""
        runs = []
        for _ in range(n):
            self.points = []
            self(("step",))
            step(accum)
            self(("end",))
            if self.cuda:
                torch.cuda.synchronize()
            t0 = self.points[0][1]
            runs.append([(k, t0.elapsed_time(e) / 1e3 if self.cuda else e - t0) for k, e in self.points])
        return runs


def timed(step, accum: int, args, device) -> float:
    """Median seconds of step(accum) over --steps after --warmup."""
    for _ in range(args.warmup):
        step(accum)
    return statistics.median(r[-1][1] for r in Marks(device).steps(step, accum, args.steps))


def instrument(model, marks, routes: dict):
    """Each decoder layer runs its phases as DecoderLayer.forward does, marking each phase's start;
    a hook on the layer's input marks when its gradient is complete (the layer's backward done)."""
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        def forward(h, rope, layer=layer, i=i):
            if h.requires_grad:
                h.register_hook(lambda g, i=i: marks(("B", i)))
            state = {"h": h}
            for ph in layer.phases(rope):
                marks(("F", i, ph.name))
                state.update(ph.fn(**{n: state[n] for n in ph.inputs}))
            if "idx" in state:
                routes[i] = state["idx"].detach()
            if i == len(layers) - 1:
                marks(("F", "head"))
                if state["out"].requires_grad:
                    state["out"].register_hook(lambda g: marks(("B", "head")))
            return state["out"]
        layer.forward = forward
    model.register_forward_pre_hook(lambda mod, args: marks(("F", "start")))
    model.register_forward_hook(lambda mod, args, out: marks(("F", "end")))


def costs_of_step(points: list[tuple], n_layers: int) -> tuple[list[dict], float]:
    """From one instrumented step's marks, per micro-batch {embed, head: {F, BW}, layers[i]: {F, BW,
    phases: {name: F}}}, and the step's tail (its end after the last layer's backward). A phase
    lasts until the next mark; the embedding's backward until the next micro-batch starts."""
    mbs, t_b = [], None
    for (key, s), (_, nxt) in zip(points, points[1:]):
        if key == ("F", "start"):
            if mbs:
                mbs[-1]["embed"]["BW"] = s - t_b
            mbs.append(mb := {"embed": {"F": 0.0, "BW": 0.0}, "head": {},
                              "layers": [{"F": 0.0, "BW": 0.0, "phases": {}} for _ in range(n_layers)]})
            start = s
        elif key[0] == "F" and isinstance(key[1], int):
            if key[1] == 0 and not mb["layers"][0]["phases"]:
                mb["embed"]["F"] = s - start
            mb["layers"][key[1]]["phases"][key[2]] = nxt - s
            mb["layers"][key[1]]["F"] += nxt - s
        elif key == ("F", "head"):
            t_head = s
        elif key == ("F", "end"):
            mb["head"]["F"], t_b = s - t_head, s
        elif key == ("B", "head"):
            mb["head"]["BW"], t_b = s - t_b, s
        elif key[0] == "B":
            mb["layers"][key[1]]["BW"], t_b = s - t_b, s
    return mbs, points[-1][1] - t_b


# ---------------------------------------------------------------------------------------------
# Costs


def make(cfg, path: str, device):
    """(model, step(accum)) on a path: train.py's one-GPU step (train), its bf16-parameter twin
    (bench), or train.py's build (build.build_run) on one GPU on the FSDP path (ParallelDims
    .one_gpu_fsdp: FSDP2 on one-rank meshes, its hooks, casts, gathers and reduce-scatters as
    copies, the experts behind the expert-parallel dispatcher), the experts left out of FSDP as a
    rank's own experts are (fsdp) or inside it (fsdp_sharded)."""
    cuda = device.type == "cuda"
    if not path.startswith("fsdp"):
        variant = bench.parse_variant("fused+compile" + ("+bf16" if path == "bench" else ""))
        return bench.pithtrain_step(cfg, {**variant, "compile": cuda}, device)
    t = cfg.train
    t.kernels, t.compile, t.activation_checkpoint, t.fp8 = "auto", cuda, "none", False
    dims = ParallelDims(one_gpu_fsdp="experts_sharded" if path == "fsdp_sharded" else "experts_alone").init(device)
    torch._dynamo.reset()
    run = build_run(cfg, device, dims)
    return run.model, bench.step_of(run)


def experts_curve(cfg, device, args, fp8: bool) -> dict:
    """{ep: {F, BW}} of the experts phase alone, E / ep experts, T x top_k balanced rows."""
    m, cuda = cfg.model, device.type == "cuda"
    use = kernels.configure("auto", device, fp8=fp8, bf16=cuda, fsdp=False, experts_alone=False, cp=False)
    rows = cfg.train.micro_batch_size * cfg.train.seq_len * m.top_k
    ref = next(mod for mod in use_kernels(build_model(m, device, init=False), use).modules()
               if isinstance(mod, GroupedExperts))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = {}

    def best(fn):  # the least of three medians: one point's stray 0.2 s (2026-12-03) read as 100x
        return min(timed(fn, 1, args, device) for _ in range(3))

    for ep in (1, 2, 4, 8):
        E = m.num_experts // ep
        ex = GroupedExperts(E, ref.dim, ref.hidden, ref.b13_EF2 is not None, ref.alpha, ref.limit).to(device, dtype)
        for p in ex.parameters():
            torch.nn.init.normal_(p, std=0.02)
        ex.mm, ex.swiglu, ex.bias_add = ref.mm, ref.swiglu, ref.bias_add  # an FP8 cache keys on the parameter
        counts = torch.full((E,), rows // E, dtype=torch.int64, device=device)
        x = torch.randn(int(counts.sum()), ref.dim, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn(x.shape[0], ref.dim, device=device, dtype=dtype)
        f = best(lambda _: ex(x, counts))
        out[str(ep)] = {"F": f, "BW": best(lambda _: ex(x, counts).backward(dy)) - f}
    return out


def balance(cfg, routes: dict) -> dict:
    """Over ep groups of the calibration routing: the busiest group's load / the mean, and the
    distinct other groups a token's experts are in, i.e. its deduplicated remote rows."""
    m, groups, rows = cfg.model, {}, {}
    for ep in (1, 2, 4, 8):
        imb, dest = [], []
        for idx in routes.values():
            d = idx // (m.num_experts // ep)
            load = torch.bincount(d.flatten(), minlength=ep).double()
            imb.append(float(load.max() / load.mean()))
            dest.append(float(sum((d == r).any(dim=1).double() for r in range(ep)).mean()) * (ep - 1) / ep)
        groups[str(ep)], rows[str(ep)] = statistics.mean(imb), statistics.mean(dest)
    return {"group_max_mean": groups, "remote_rows_per_token": rows}


def model_costs(name: str, cfg, device, args, old: dict) -> dict:
    """A family's entry in the cost file: its costs' FLOPs; per --paths path (the old entry's others
    kept) embed, head {F, BW}, the tail per parameter and per layer kind {first, later: {F, BW},
    phases_F: each phase's share of the forward}, medians over the instrumented steps; the experts
    curves (bf16, FP8) and the routing's balance."""
    m, t0, routes, med, mean = cfg.model, time.perf_counter(), {}, statistics.median, statistics.mean
    fam = {"paths": {}, **old, "recipe": name, "tokens": cfg.train.micro_batch_size * cfg.train.seq_len,
           "head_flops": 2 * m.vocab_size * m.hidden_size,
           "layer_flops": {perf.layer_kind(m, i): perf.layer_flops(m, i, cfg.train.seq_len)[0]
                           for i in range(m.num_layers)}}
    for path in args.paths:
        model, step = make(cfg, path, device)
        for _ in range(args.warmup + 1):  # one more: compile
            step(2)
        marks = Marks(device)
        instrument(model, marks, routes)
        n = len(decoder_layers(model))
        runs = [costs_of_step(points[1:], n) for points in marks.steps(step, 2, args.steps)]
        fam["paths"][path] = c = {
            "embed": {k: med(r[0][0]["embed"][k] for r in runs) for k in ("F", "BW")},
            "head": {k: med(r[0][-1]["head"][k] for r in runs) for k in ("F", "BW")},
            "tail_per_param": med(r[1] for r in runs) / sum(p.numel() for p in model.parameters()), "layers": {}}
        for kind in {perf.layer_kind(m, i) for i in range(n)}:
            ids = [i for i in range(n) if perf.layer_kind(m, i) == kind]
            ph = {phase: med(mean(r[0][1]["layers"][i]["phases"][phase] for i in ids) for r in runs)
                  for phase in runs[0][0][1]["layers"][ids[0]]["phases"]}
            c["layers"][kind] = {w: {k: med(mean(r[0][mb]["layers"][i][k] for i in ids) for r in runs)
                                     for k in ("F", "BW")}
                                 for w, mb in (("first", 0), ("later", 1))}
            c["layers"][kind]["phases_F"] = {k: v / sum(ph.values()) for k, v in ph.items()}
        del model, step
        bench.free()
        print(f"calibrate: {name} {path} ({time.perf_counter() - t0:.0f} s): " + ", ".join(
            f"{k} F {1e3 * v['later']['F']:.2f} BW {1e3 * v['later']['BW']:.2f} ms" for k, v in c["layers"].items())
            + f", head {1e3 * c['head']['F']:.2f} + {1e3 * c['head']['BW']:.2f} ms, "
            f"tail {1e9 * c['tail_per_param']:.3f} ns/param",
            flush=True)
    fam["experts"] = experts_curve(cfg, device, args, fp8=False)
    fam["experts_fp8"] = fam["experts"] if args.cpu else experts_curve(cfg, device, args, fp8=True)
    fam["balance"] = balance(cfg, routes) if routes else old["balance"]  # no path measured: the old one
    return fam


# ---------------------------------------------------------------------------------------------
# Entry point


def line(c: dict) -> str:  # a check's row of the table
    return f"| {c['model']} | {c['path']} | {c['layers']} | " + (
        f"{c['mb']} | {c['measured_ms']:.1f} | {c['predicted_ms']:.1f} | {c['ratio']:.3f} |" if "ratio" in c
        else f"refused: {c['refused']} | | | |")


def main(argv=None) -> int:
    def items(s: str) -> list[str]:
        return [x for x in s.split(",") if x]

    p = argparse.ArgumentParser(prog="python scripts/calibrate.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=items, default="qwen3-30b-a3b,deepseek-v2-lite,gpt-oss-20b")
    p.add_argument("--out", type=Path, default=perf.COSTS)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--paths", type=items, default="bench,train,fsdp,fsdp_sharded",
                   help="paths to measure (others are kept)")
    p.add_argument("--checks", type=items, default="bench:4,bench:12,train:4,fsdp:4,fsdp_sharded:4",
                   help="path:layers, comma-separated")
    p.add_argument("--accums", type=items, default="1,8", help="micro-batches per step of each check, comma-separated")
    p.add_argument("--cpu", action="store_true", help="tiny widths on CPU (the test's dry run)")
    args = p.parse_args(argv)
    device, seq, mb = torch.device("cpu" if args.cpu else "cuda"), 64 if args.cpu else 4096, 2
    data = json.loads(args.out.read_text()) if args.out.is_file() else {"families": {}}
    gpu = "cpu" if args.cpu else torch.cuda.get_device_name()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    facts = dict(fp8=False, bf16=not args.cpu, fsdp=False, experts_alone=False, cp=False)
    data.update(date=datetime.date.today().isoformat(), commit=commit, gpu=gpu_key(gpu) or "h200",
                device=gpu_key(gpu) or gpu.lower(), torch=torch.__version__,
                triton=kernels.HAVE_TRITON and __import__("triton").__version__,
                fa4=kernels.configure("auto", device, **facts)["fa4"])
    checks = []
    for name in args.models:
        family = load_config(name).model.family
        tiny = TINY[family] if args.cpu else []
        cfg = bench.bench_config(name, CAL_LAYERS[family], mb, seq, 2, tiny)
        data["families"][family] = model_costs(name, cfg, device, args, data["families"].get(family, {}))
        args.out.write_text(json.dumps(data, indent=1) + "\n")
        mine = []
        for spec in args.checks:
            path, layers = spec.split(":")
            row = {"model": name, "path": path, "layers": int(layers)}
            check = bench.bench_config(name, int(layers), mb, seq, 8, tiny)
            try:
                model, step = make(check, path, device)
                for accum in map(int, args.accums):
                    measured = timed(step, accum, args, device)
                    check.train.grad_accum = accum
                    pred = perf.predict(check, {"pp": 1, "dp": 1, "fsdp": 1, "cp": 1, "ep": 1}, data["gpu"], data,
                                        path=path)["step_s"]
                    mine.append({**row, "mb": accum, "measured_ms": 1e3 * measured, "predicted_ms": 1e3 * pred,
                                 "ratio": pred / measured, "commit": commit})
                    print(f"calibrate: check {line(mine[-1])}", flush=True)
                del model, step
            except bench.PlanRefused as e:
                mine.append({**row, "refused": str(e)})
            bench.free()
        checks += mine
        data["checks"] = [c for c in data.get("checks", []) if c["model"] != name] + mine
        args.out.write_text(json.dumps(data, indent=1) + "\n")
    print("| model | path | layers | mb | measured ms | predicted ms | predicted / measured |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(map(line, checks)))
    if dist.is_initialized():  # the fsdp paths' one-rank group
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
