"""Measure the performance model's costs on one GPU (pithtrain/perf.py), and check the model's
one-GPU predictions against steps measured in the same call.

    python scripts/calibrate.py --models qwen3-30b-a3b      # one device call a model: pithtrain/costs_h200.json
    python scripts/calibrate.py --cpu --out /tmp/costs.json                        # tiny widths on CPU (a test)

Per model (its recipe at real widths, micro-batch 2 x 4096, bf16 compute):
  1. costs: a short model (Qwen3 2 MoE layers; DeepSeek its dense layer + 2 MoE; GPT-OSS a window and
     a full layer) on each path (perf.py: train, fsdp, bench), 2 micro-batches a step, the real
     `train.train_step` with CUDA events at every layer boundary, forward and backward, and at every
     phase of the forward (no synchronisation: the events partition the GPU's timeline, idle included);
  2. the experts phase alone at ep = 1, 2, 4, 8 (E / ep experts, T x top_k rows), bf16 and FP8;
  3. the balance of that routing over ep groups, and its deduplicated remote rows per token;
  4. checks: bench's step (bf16 parameters) at 4 and 12 layers, train.py's own and the FSDP path at 4
     layers, each at 1 and 8 micro-batches, measured (median of --steps after --warmup) beside
     perf.predict from the costs of 1-3 only.
Merges the model's entry and its checks into --out (with date, commit, device and package versions);
prints the checks' table last.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pithtrain import bench, kernels, perf
from pithtrain.config import load_config
from pithtrain.distributed.expert_parallel import ExpertParallelDispatcher
from pithtrain.distributed.parallel_dims import ParallelDims
from pithtrain.distributed.parallelize import materialize, moe_blocks, parallelize
from pithtrain.models import build_model
from pithtrain.models.common import GroupedExperts, decoder_layers, set_aux_loss_scale, use_kernels
from pithtrain.train import build_optimizer, lr_lambda, train_step

CAL_LAYERS = {"qwen3_moe": 2, "deepseek_v2": 3, "gpt_oss": 2}
_TINY = ["model.vocab_size=512", "model.hidden_size=64", "model.num_heads=4", "model.num_experts=8", "model.top_k=2"]
TINY = {"qwen3_moe": _TINY + ["model.num_kv_heads=2", "model.head_dim=16", "model.moe_intermediate_size=32"],
        "deepseek_v2": _TINY + ["model.kv_lora_rank=16", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8",
                                "model.v_head_dim=16", "model.intermediate_size=64", "model.moe_intermediate_size=32"],
        "gpt_oss": _TINY + ["model.num_kv_heads=2", "model.head_dim=16", "model.intermediate_size=32",
                            "model.sliding_window=16"]}


class OneRankFSDP(ParallelDims):
    """FSDP2 on a one-rank mesh: an FSDP layout's per-GPU compute (hooks, casts, gathers and
    reduce-scatters as local copies) on one GPU. Its experts are its own (efsdp = edp = 1), so FSDP
    leaves them out, as on fsdp=8 ep=8."""
    fsdp_enabled = property(lambda self: True)


class OneRankFSDPSharded(OneRankFSDP):
    """The same with the experts inside FSDP, as layouts that shard or replicate them (efsdp or edp > 1)."""
    experts_alone = property(lambda self: False)


class Marks:
    """Points on the device's timeline: CUDA events (no synchronisation), the host clock on CPU."""

    def __init__(self, device):
        self.cuda, self.points = device.type == "cuda", []

    def __call__(self, key):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.points.append((key, ev))
        else:
            self.points.append((key, time.perf_counter()))

    def seconds(self) -> list[tuple]:
        if self.cuda:
            torch.cuda.synchronize()
            return [(k, self.points[0][1].elapsed_time(e) / 1e3) for k, e in self.points]
        return [(k, t - self.points[0][1]) for k, t in self.points]


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
    for k, (key, s) in enumerate(points[:-1]):
        nxt = points[k + 1][1]
        if key == ("F", "start"):
            if mbs:
                mbs[-1]["embed"]["BW"] = s - t_b
            mb = {"embed": {"F": 0.0, "BW": 0.0}, "head": {},
                  "layers": [{"F": 0.0, "BW": 0.0, "phases": {}} for _ in range(n_layers)]}
            mbs.append(mb)
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


def timed(step, accum: int, warmup: int, steps: int, device) -> float:
    for _ in range(warmup):
        step(accum)
    times = []
    for _ in range(steps):
        marks = Marks(device)
        marks("start")
        step(accum)
        marks("end")
        times.append(marks.seconds()[-1][1])
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# The three paths


def fsdp_step(cfg, device, sharded: bool = False):
    """The FSDP path on one rank: train.py's build (use_kernels, parallelize, materialise) on a
    one-rank mesh, experts behind the expert-parallel dispatcher; (model, step(accum))."""
    t = cfg.train
    t.kernels, t.compile, t.activation_checkpoint, t.fp8 = "auto", device.type == "cuda", "none", False
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    dims = (OneRankFSDPSharded if sharded else OneRankFSDP)(world_size=1).build_meshes(device.type)
    use = kernels.configure("auto", device, fsdp=True, bf16=device.type == "cuda", experts_alone=dims.experts_alone)
    torch._dynamo.reset()
    model = use_kernels(build_model(cfg.model, init=False), use)
    model.train()
    parallelize(model, dims, t, device)
    for m in moe_blocks(model):
        m.dispatcher = ExpertParallelDispatcher(dims.ep_group, 0, 1, m.experts.num_experts, fused=m.dispatcher.fused)
    materialize(model, build_model(cfg.model, init=False), device, t.seed)
    opt = build_optimizer(model, cfg, device, use)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    x, y = bench.random_batch(cfg, device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    def step(accum: int = t.grad_accum):
        set_aux_loss_scale(model, 1.0 / accum)
        return train_step(model, opt, sched, [(x, y, None, None)] * accum, y.numel() * accum, cfg, dims, autocast).loss

    return model, step


def make(cfg, path: str, device):
    if path.startswith("fsdp"):
        return fsdp_step(cfg, device, sharded=path == "fsdp_sharded")
    variant = bench.parse_variant("fused+compile" + ("+bf16" if path == "bench" else ""))
    variant["compile"] = device.type == "cuda"
    return bench.pithtrain_step(cfg, variant, device)


def calibrate_path(cfg, path: str, device, args, routes: dict) -> dict:
    model, step = make(cfg, path, device)
    step(2)
    for _ in range(args.warmup):
        step(2)
    runs = []
    marks = Marks(device)
    instrument(model, marks, routes)
    n = len(decoder_layers(model))
    for _ in range(args.steps):
        marks.points = []
        marks(("step",))
        step(2)
        marks(("end",))
        runs.append(costs_of_step(marks.seconds()[1:], n))
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    med = statistics.median
    out = {"embed": {k: med(r[0][0]["embed"][k] for r in runs) for k in ("F", "BW")},
           "head": {k: med(r[0][-1]["head"][k] for r in runs) for k in ("F", "BW")},
           "tail_per_param": med(r[1] for r in runs) / params, "layers": {}}
    for kind in {perf.layer_kind(cfg.model, i) for i in range(n)}:
        ids = [i for i in range(n) if perf.layer_kind(cfg.model, i) == kind]
        entry = {w: {k: med(statistics.mean(r[0][mb]["layers"][i][k] for i in ids) for r in runs)
                     for k in ("F", "BW")} for w, mb in (("first", 0), ("later", 1))}
        ph = {name: med(statistics.mean(r[0][1]["layers"][i]["phases"][name] for i in ids) for r in runs)
              for name in runs[0][0][1]["layers"][ids[0]]["phases"]}
        entry["phases_F"] = {k: v / sum(ph.values()) for k, v in ph.items()}
        out["layers"][kind] = entry
    del model, step
    free(device)
    return out


def experts_curve(cfg, device, args, fp8: bool) -> dict:
    """{ep: {F, BW}} of the experts phase alone, E / ep experts, T x top_k balanced rows."""
    m, use = cfg.model, kernels.configure("auto", device, fp8=fp8, bf16=device.type == "cuda")
    T = cfg.train.micro_batch_size * cfg.train.seq_len
    probe = use_kernels(build_model(cfg.model, device, init=False), use)
    ref = next(mod for mod in probe.modules() if isinstance(mod, GroupedExperts))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = {}
    for ep in (1, 2, 4, 8):
        E = m.num_experts // ep
        ex = GroupedExperts(E, ref.dim, ref.hidden, ref.b13_EF2 is not None, ref.alpha, ref.limit).to(device, dtype)
        for p in ex.parameters():
            torch.nn.init.normal_(p, std=0.02)
        ex.mm, ex.swiglu, ex.bias_add = ref.mm, ref.swiglu, ref.bias_add  # an FP8 cache keys on the parameter
        rows = T * m.top_k
        counts = torch.full((E,), rows // E, dtype=torch.int64, device=device)
        x = torch.randn(int(counts.sum()), ref.dim, device=device, dtype=dtype, requires_grad=True)

        dy = torch.randn(x.shape[0], ref.dim, device=device, dtype=dtype)
        def best(fn):  # the least of three medians: one point's stray 0.2 s (2026-12-03) read as 100x
            return min(timed(fn, 1, args.warmup, args.steps, device) for _ in range(3))
        f = best(lambda _: ex(x, counts))
        fb = best(lambda _: ex(x, counts).backward(dy))
        out[str(ep)] = {"F": f, "BW": fb - f}
    del probe
    return out


def balance(cfg, routes: dict) -> dict:
    m, groups, rows = cfg.model, {}, {}
    for ep in (1, 2, 4, 8):
        per = m.num_experts // ep
        imb, dest = [], []
        for idx in routes.values():
            load = torch.bincount((idx // per).flatten(), minlength=ep).double()
            imb.append(float(load.max() / load.mean()))
            d = idx // per
            distinct = sum((d == r).any(dim=1).double() for r in range(ep))
            dest.append(float(distinct.mean()) * (ep - 1) / ep)
        groups[str(ep)], rows[str(ep)] = statistics.mean(imb), statistics.mean(dest)
    return {"group_max_mean": groups, "remote_rows_per_token": rows}


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Entry point


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/calibrate.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3-30b-a3b,deepseek-v2-lite,gpt-oss-20b")
    p.add_argument("--out", default=str(perf.COSTS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--paths", default="bench,train,fsdp,fsdp_sharded", help="paths to measure (others are kept)")
    p.add_argument("--checks", default="bench:4,bench:12,train:4,fsdp:4,fsdp_sharded:4", help="path:layers, comma-separated")
    p.add_argument("--accums", default="1,8", help="micro-batches per step of each check, comma-separated")
    p.add_argument("--cpu", action="store_true", help="tiny widths on CPU (the test's dry run)")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.cpu else "cuda")
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.is_file() else {"families": {}}
    gpu = "cpu" if args.cpu else torch.cuda.get_device_name().split()[-1].lower()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    data.update(date=datetime.date.today().isoformat(), commit=commit, gpu=gpu if gpu in perf.GPUS else "h200",
                device=gpu, torch=torch.__version__, triton=kernels.HAVE_TRITON and __import__("triton").__version__,
                fa4=kernels.configure("auto", device).get("fa4", False))
    checks = []
    for name in [s for s in args.models.split(",") if s]:
        seq, mb = (64, 2) if args.cpu else (4096, 2)
        family = load_config(name).model.family
        tiny = TINY[family] if args.cpu else []
        cfg = bench.bench_config(name, CAL_LAYERS[family], mb, seq, 2, tiny)
        m = cfg.model
        fam = {"paths": {}, **data["families"].get(family, {}), "recipe": name, "tokens": mb * seq,
               "head_flops": 2 * m.vocab_size * m.hidden_size,
               "layer_flops": {perf.layer_kind(m, i): perf.layer_flops(m, i, seq)[0] for i in range(m.num_layers)}}
        routes = {}
        t0 = time.perf_counter()
        for path in [s for s in args.paths.split(",") if s]:
            fam["paths"][path] = c = calibrate_path(cfg, path, device, args, routes)
            print(f"calibrate: {name} {path} ({time.perf_counter() - t0:.0f} s): " + ", ".join(
                f"{k} F {1e3 * v['later']['F']:.2f} BW {1e3 * v['later']['BW']:.2f} ms" for k, v in c["layers"].items())
                + f", head {1e3 * c['head']['F']:.2f} + {1e3 * c['head']['BW']:.2f} ms, tail {1e9 * c['tail_per_param']:.3f} ns/param",
                flush=True)
        fam["experts"] = experts_curve(cfg, device, args, fp8=False)
        fam["experts_fp8"] = experts_curve(cfg, device, args, fp8=not args.cpu) if not args.cpu else fam["experts"]
        fam["balance"] = balance(cfg, routes)
        data["families"][cfg.model.family] = fam
        out.write_text(json.dumps(data, indent=1) + "\n")
        for spec in [s for s in args.checks.split(",") if s]:
            path, layers = spec.split(":")
            check = bench.bench_config(name, int(layers), mb, seq, 8, tiny)
            try:
                model, step = make(check, path, device)
                for accum in [int(a) for a in args.accums.split(",")]:
                    measured = timed(step, accum, args.warmup, args.steps, device)
                    check.train.grad_accum = accum
                    pred = perf.predict(check, {"pp": 1, "dp": 1, "fsdp": 1, "cp": 1, "ep": 1}, data["gpu"], data,
                                        path=path)["step_s"]
                    checks.append({"model": name, "path": path, "layers": int(layers), "mb": accum,
                                   "measured_ms": 1e3 * measured, "predicted_ms": 1e3 * pred,
                                   "ratio": pred / measured, "commit": commit})
                    print(f"calibrate: check {checks[-1]}", flush=True)
                del model, step
            except bench.PlanRefused as e:
                checks.append({"model": name, "path": path, "layers": int(layers), "refused": str(e)})
            free(device)
        data["checks"] = [c for c in data.get("checks", []) if c["model"] != name] + [c for c in checks if c["model"] == name]
        out.write_text(json.dumps(data, indent=1) + "\n")
    print("| model | path | layers | mb | measured ms | predicted ms | predicted / measured |\n| --- | --- | --- | --- | --- | --- | --- |")
    for c in checks:
        print(f"| {c['model']} | {c['path']} | {c['layers']} | " + (
            f"{c['mb']} | {c['measured_ms']:.1f} | {c['predicted_ms']:.1f} | {c['ratio']:.3f} |" if "ratio" in c
            else f"refused: {c['refused']} | | | |"))
    if dist.is_initialized():  # the fsdp paths' one-rank group
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
