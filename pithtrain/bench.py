"""Single-GPU throughput suite (docs/bench.md): each family at its real widths, truncated to
--layers layers (12; 4 is the secondary line), micro-batch 2 x sequence 4096, random init, at 1 and
8 micro-batches per optimizer step; PithTrain and its peers (Hugging Face transformers, torchtitan
where installed) on the identical configuration, in one process, one table.

    python -m pithtrain.bench                                   # all families, default variants
    python -m pithtrain.bench --models qwen3-30b-a3b --layers 4 --variants ref,fused+compile --grad-accum 1
    python -m pithtrain.bench --layers 4 --variants fused+compile,fused+compile+bf16 --peers transformers
    invoke bench

The step timed is train.py's own (train.train_step: forward of each micro-batch, backward of loss /
tokens, the recipe's global clip, AdamW (kernels/adamw.py) on fp32 master weights, bf16 compute on
the step's bf16 weight copy, the balancing update, the LR schedule) on train.py's build
(build.build_run: kernels, parallelize, the run's precision); the
peers' is forward, backward, clip to 1.0, fused AdamW around their own model classes in bf16
(torchtitan's with its per-block torch.compile and its loss).
A variant is '+'-joined words: `ref` (PyTorch reference operators, kernels=torch) or `fused`
(kernels=auto); `compile` (train.compile); `ac-full` / `ac-sel` (activation checkpointing);
`bf16` (a comparison with the peers, not a training setting: the training state "bf16",
precision.STATES: bf16 parameters and AdamW state);
`fp8` (train.fp8: blockwise FP8 expert GEMMs, on DeepGEMM where installed (kernels/deepgemm.py), else
Triton (kernels/fp8_linear.py); `--fp8` adds `<first variant>+fp8`, so bf16 and FP8 are timed in the
same run); `no-NAME` turns one fused operator off (names: pithtrain.kernels.NAMES; `no-deepgemm`:
FP8 on Triton). `--doc-len N`: document masking on random documents of mean length N (PithTrain's
sides only).
Timing: CUDA events around each step after warm-up; the median of the timed steps.
MFU = tokens/s x model FLOPs per token (pithtrain.metrics.flops_per_token) / the GPU's dense bf16
peak (pithtrain/gpus.py, metrics.peak_tflops: 989e12 on H100/H200).
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import json
import statistics
import sys
import time
import traceback

import torch

from pithtrain import kernels
from pithtrain.build import Run, build_run
from pithtrain.config import load_config
from pithtrain.distributed.parallel_dims import ParallelDims
from pithtrain.kernels import fp8_linear, wgrad
from pithtrain.metrics import flops_per_token, param_counts, peak_tflops
from pithtrain.models import build_model
from pithtrain.models.common import attention_kernels
from pithtrain.plan import plan
from pithtrain.train import cuda_allocator, train_step

MODELS = ["deepseek-v2-lite", "qwen3-30b-a3b", "gpt-oss-20b"]  # recipe names
HF_ATTENTION = {"gpt_oss": "eager"}  # transformers 5.17 has no SDPA path for sinks
DEFAULT_VARIANTS = "fused+compile,fused+compile+bf16"  # train.py's step and its bf16-parameter twin
PEERS = ["transformers", "torchtitan"]
# recipe family -> torchtitan's package, flavour table, flavour and model class: its own classes at
# the real widths (torchtitan 0.2.2; the parameter count is checked against ours before timing)
TORCHTITAN = {"deepseek_v2": ("deepseek_v3", "deepseekv3_args", "16B", "DeepSeekV3Model"),
              "qwen3_moe": ("qwen3", "qwen3_args", "30B-A3B", "Qwen3Model"),
              "gpt_oss": ("gpt_oss", "gptoss_configs", "20b", "GptOssModel")}


# ---------------------------------------------------------------------------------------------
# Setup


def bench_config(name: str, layers: int, batch: int, seq: int, grad_accum: int = 1, extra: list = ()):
    one_gpu = [f"parallel.{k}=1" for k in ("pp", "dp", "fsdp", "cp", "ep")]
    cfg = load_config(name, [f"model.num_layers={layers}", f"train.micro_batch_size={batch}",
                             f"train.seq_len={seq}", f"train.grad_accum={grad_accum}", *one_gpu,
                             "train.global_batch_tokens=null", "train.activation_checkpoint=none", *extra])
    if hasattr(cfg.model, "max_position_embeddings"):
        cfg.model.max_position_embeddings = max(cfg.model.max_position_embeddings, seq)
    return cfg


def parse_variant(v: str) -> dict:
    words = v.split("+")
    out = {"kernels": "torch" if "ref" in words else "auto", "compile": "compile" in words,
           "ac": "full" if "ac-full" in words else "selective" if "ac-sel" in words else "none",
           "bf16": "bf16" in words, "fp8": "fp8" in words,
           "off": [w[3:] for w in words if w.startswith("no-")]}
    unknown = [w for w in words if w not in ("ref", "fused", "compile", "ac-full", "ac-sel", "bf16", "fp8")
               and not w.startswith("no-")]
    if unknown or any(o not in kernels.NAMES for o in out["off"]):
        raise SystemExit(f"bench: unknown variant words in {v!r}: {unknown or out['off']}")
    if out["fp8"] and out["kernels"] == "torch":
        raise SystemExit(f"bench: {v!r}: fp8 runs Triton GEMMs, it does not go with ref (train.fp8 needs kernels=auto)")
    if "deepgemm" in out["off"] and not out["fp8"]:
        raise SystemExit(f"bench: {v!r}: no-deepgemm changes only fp8 variants (DeepGEMM runs the FP8 expert GEMMs)")
    return out


def random_batch(cfg, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, S, V = cfg.train.micro_batch_size, cfg.train.seq_len, cfg.model.vocab_size
    ids = torch.randint(0, V, (B, S + 1), generator=g)
    return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)


def random_documents(cfg, device, mean_len: int, seed=0):
    """(B, S) document index per token (data.document_mask) for the bench's rows: each row cut into
    documents of exponentially distributed lengths of mean `mean_len` tokens (at least 1; the last
    cut at the row's end), as packed pretraining text is."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, S = cfg.train.micro_batch_size, cfg.train.seq_len
    rows = []
    for _ in range(B):
        ids, n = [], 0
        while len(ids) < S:
            length = max(1, round(-mean_len * torch.log(1 - torch.rand((), generator=g)).item()))
            ids += [n] * length
            n += 1
        rows.append(ids[:S])
    return torch.tensor(rows, device=device)


def free():
    gc.collect()
    if torch.cuda.is_initialized():  # not on CPU (scripts/calibrate.py --cpu)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def time_steps(step, warmup: int, steps: int) -> tuple[list[float], float]:
    """Per-step milliseconds (CUDA events) after `warmup` untimed steps; and the warm-up seconds."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times, warm_s


# ---------------------------------------------------------------------------------------------
# The sides


class PlanRefused(Exception):
    """train.py would refuse this configuration on this GPU (its memory plan does not fit): the
    bench says so in the row instead of timing an out-of-memory."""


def refused_by_plan(cfg, gpu_gib: float, gpu: str = "") -> str | None:
    """Why train.py would refuse cfg on one GPU of gpu_gib GiB (its memory plan), or None."""
    p = plan(cfg, 1, gpu_gib, gpu)
    return None if p["fits"] else (f"train.py refuses it here: memory plan {p['peak_gib']:.1f} GiB of "
                                   f"{p['usable_gib']:.1f} usable")


def pithtrain_step(cfg, variant: dict, device, doc_len: int = 0):
    """train.py's own step (train.train_step) on train.py's build (build.build_run: kernels,
    checkpointing and compile, one process), fp32 master weights and AdamW state, bf16 compute on
    the bf16 copy (precision.py), the recipe's clip, the LR schedule and the balancing update.
    Only `bf16` departs from it: parameters (and so AdamW state) in bf16, as the peers run (the
    training state "bf16"); the weights are drawn on the GPU (their values do not change the time).
    doc_len: document masking on documents of that mean length (random_documents), else none."""
    t = cfg.train
    t.kernels, t.compile, t.activation_checkpoint, t.fp8 = (variant["kernels"], variant["compile"],
                                                            variant["ac"], variant["fp8"])
    if not variant["bf16"] and device.type == "cuda":  # what train.py checks before it builds anything
        why = refused_by_plan(cfg, torch.cuda.get_device_properties(device).total_memory / 2**30,
                              torch.cuda.get_device_name(device))
        if why:
            raise PlanRefused(why)
    torch._dynamo.reset()  # each variant compiles its own model from a clean cache
    torch.manual_seed(0)
    run = build_run(cfg, device, ParallelDims.from_config(cfg, 1, 0), state="bf16" if variant["bf16"] else "float32",
                    off=tuple(variant["off"]), draws="device")
    print("bench:   " + kernels.describe(run.use, attention_kernels(run.model, run.use)), flush=True)
    return run.model, step_of(run, random_documents(cfg, device, doc_len) if doc_len else None)


def step_of(run: Run, docs=None):
    """step(accum) -> loss: train.train_step of a built run (its precision, AdamW, the LR
    schedule) on one fixed random batch, `accum` micro-batches a step (scripts/calibrate.py times
    one run at several, and builds its one-GPU FSDP run too)."""
    x, y = random_batch(run.cfg, run.device)

    def step(accum: int = run.cfg.train.grad_accum):
        return train_step(run, [(x, y, None, docs)] * accum, y.numel() * accum).loss

    return step


def hf_step(cfg, device):
    import transformers

    hf = cfg.model.to_hf()
    model_type = hf.pop("model_type")
    hf.pop("architectures", None)
    hf_cfg = transformers.AutoConfig.for_model(model_type, **hf)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            hf_cfg, dtype=torch.bfloat16, attn_implementation=HF_ATTENTION.get(cfg.model.family, "sdpa"),
            experts_implementation="grouped_mm")
    model.train()
    x, _ = random_batch(cfg, device)
    return model, peer_step(cfg, model, lambda: model(input_ids=x, labels=x).loss / cfg.train.grad_accum)


def peer_step(cfg, model, micro_loss):
    """A peer's step: train.grad_accum backward passes of `micro_loss()` (one micro-batch's share of
    the step's loss), clip to 1.0, fused AdamW at the recipe's settings; step() returns the step's loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2),
                            weight_decay=cfg.train.weight_decay, fused=True)
    accum = cfg.train.grad_accum

    def step():
        for _ in range(accum):
            loss = micro_loss()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss * accum

    return step


def torchtitan_step(cfg, device, compile: bool):
    """torchtitan's model class for the family at its published flavour, truncated to the same
    layers and sequence, bf16 parameters (as the transformers peer), its per-block torch.compile
    (llama4's apply_compile, which its Qwen3 and DeepSeek trainers call; its GPT-OSS trainer does not
    compile, the bench does), its loss (sum of cross-entropy over float32 logits, divided here by the
    step's tokens; compiled with the model, as its default compile components say), clip to 1.0,
    fused AdamW. ImportError when not installed."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import JobConfig
    from torchtitan.config.job_config import Compile
    from torchtitan.models.llama4.infra.parallelize import apply_compile

    package, flavours, flavour, cls = TORCHTITAN[cfg.model.family]
    mod = importlib.import_module(f"torchtitan.models.{package}")
    args = copy.deepcopy(getattr(mod, flavours)[flavour])
    job = JobConfig()
    job.training.seq_len = cfg.train.seq_len
    args.n_layers = cfg.model.num_layers
    args.update_from_config(job)  # as its trainer does: sequence length, MoE backend, grouped GEMMs
    if cfg.model.family == "deepseek_v2":  # the flavour's flex block-causal masks documents; ours is causal
        args.attn_type, args.attn_mask_type = "sdpa", "causal"
    with torch.device("meta"):
        model = getattr(mod, cls)(args)
        ours = param_counts(build_model(cfg.model, torch.device("meta")), cfg.model)[0]
    theirs = sum(p.numel() for p in model.parameters())
    if abs(theirs - ours) > 0.001 * ours:
        raise ValueError(f"torchtitan {package} {flavour!r} at {args.n_layers} layers has {theirs:,} "
                         f"parameters, PithTrain's {cfg.model.family} {ours:,}: not the same model")
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    for p in model.parameters():  # bf16 parameters; buffers (RoPE) as torchtitan keeps them
        p.data = p.data.to(torch.bfloat16)
    model.train()
    loss_fn = cross_entropy_loss
    if compile:
        torch._dynamo.reset()
        apply_compile(model, Compile(enable=True), ep_enabled=False)  # per block; patches moe_module
        loss_fn = torch.compile(cross_entropy_loss)  # components "model" and "loss", its default
    x, y = random_batch(cfg, device)
    masks = model.get_attention_masks(x, None) if args.attn_type == "flex" else None  # causal: no tokenizer
    tokens = y.numel() * cfg.train.grad_accum
    return model, peer_step(cfg, model, lambda: loss_fn(model(x, masks), y) / tokens)


def peer_sides(name, cfg, device, peers, warmup, steps, profile) -> list[dict]:
    """The peers' records for one model and setting; a peer that is missing or fails is a row
    saying so. torchtitan: compiled; eager as well when its compile fails."""
    recs = []
    if "transformers" in peers:
        recs.append(measure(name, "transformers", cfg, lambda: hf_step(cfg, device), warmup, steps, profile))
    if "torchtitan" in peers:
        try:
            import torchtitan  # noqa: F401
        except ImportError as e:
            return recs + [{"model": name, "side": "torchtitan", "grad_accum": cfg.train.grad_accum, "ok": False,
                            "error": f"not installed ({e}; docs/bench.md says how)"}]
        from torchtitan.models.moe import moe as moe_module

        # apply_compile replaces the experts' function module-wide and sets a dynamo flag: both go back
        experts_fn, scalar = moe_module._run_experts_grouped_mm, torch._dynamo.config.capture_scalar_outputs
        try:
            recs.append(measure(name, "torchtitan", cfg, lambda: torchtitan_step(cfg, device, True), warmup, steps,
                                profile))
            if recs[-1].get("compile_error"):  # torch.compile failed: the same model eager
                moe_module._run_experts_grouped_mm = experts_fn
                torch._dynamo.reset()
                recs.append(measure(name, "torchtitan eager", cfg, lambda: torchtitan_step(cfg, device, False),
                                    warmup, steps, profile))
        finally:
            moe_module._run_experts_grouped_mm = experts_fn
            torch._dynamo.config.capture_scalar_outputs = scalar
            torch._dynamo.reset()
    return recs


# ---------------------------------------------------------------------------------------------
# One measurement


def measure(name, side, cfg, make, warmup, steps, profile=None) -> dict:
    free()
    rec = {"model": name, "side": side, "batch": cfg.train.micro_batch_size, "seq": cfg.train.seq_len,
           "grad_accum": cfg.train.grad_accum}
    try:
        model, step = make()
        t0 = time.perf_counter()
        first = float(step())  # loss of a random model, ~ln(V); compilation happens here
        rec["first_step_s"] = time.perf_counter() - t0
        q0, a0 = fp8_linear.quantised(model), wgrad.in_place_adds(model)
        times, warm_s = time_steps(step, warmup - 1, steps)
        rec["fp8_quantised_per_step"] = (fp8_linear.quantised(model) - q0) / (warmup - 1 + steps)
        rec["wgrad_adds_per_step"] = (wgrad.in_place_adds(model) - a0) / (warmup - 1 + steps)
        if profile:
            profile_steps(step, profile, f"{name} {side}")
        tokens = cfg.train.micro_batch_size * cfg.train.seq_len * cfg.train.grad_accum
        med = statistics.median(times)
        tps = tokens / (med / 1e3)
        fpt = flops_per_token(cfg.model, cfg.train.seq_len)
        rec.update(ok=True, first_loss=first, step_ms=med, step_ms_all=times, warmup_s=warm_s,
                   tokens_per_s=tps, mfu=tps * fpt / (peak_tflops(torch.device("cuda")) * 1e12),
                   peak_gb=torch.cuda.max_memory_allocated() / 1e9, flops_per_token=fpt)
        print(f"bench: {name:18s} {side:32s} {tps / 1e3:7.1f}K tok/s  {100 * rec['mfu']:5.1f}% MFU  "
              f"{rec['peak_gb']:6.1f} GB  step {med:7.1f} ms (min {min(times):.1f}, max {max(times):.1f})"
              f"  loss0 {first:.3f}" + (f"  FP8 weight quantisations/step {rec['fp8_quantised_per_step']:g}"
                                        if rec["fp8_quantised_per_step"] else "")
              + (f"  in-place weight gradients/step {rec['wgrad_adds_per_step']:g}"
                 if rec["wgrad_adds_per_step"] else ""), flush=True)
        del model, step
    except Exception as e:  # one failing side must not lose the others' numbers
        traceback.print_exc()
        rec.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                   refused=isinstance(e, PlanRefused),
                   compile_error=isinstance(e, torch._dynamo.exc.TorchDynamoException))
        print(f"bench: {name} {side} FAILED: {rec['error']}", flush=True)
    free()
    return rec


def profile_steps(step, path, title, n=3):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=90)
    with open(path, "a") as f:
        f.write(f"\n### {title} ({n} steps)\n{table}\n")


# ---------------------------------------------------------------------------------------------
# Entry point


def table(recs: list[dict]) -> str:
    """One row per record, `mb` its micro-batches per optimizer step. Ratios within one model and
    setting: `vs transformers`, `vs torchtitan` (its compiled row, else its eager one), `fp8 vs bf16`
    (a +fp8 side against its twin without) and `vs bf16 params` (train.py's step against its +bf16
    twin, the peers' precision)."""
    lines = ["| model | mb | side | tokens/s | MFU | peak GB | step ms | vs transformers | vs torchtitan | "
             "fp8 vs bf16 | vs bf16 params |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    ok = {(r["model"], r.get("grad_accum"), r["side"]): r for r in recs if r.get("ok")}

    def ratio(r, other):
        return f"{r['tokens_per_s'] / other['tokens_per_s']:.2f}x" if other else "-"

    for r in recs:
        m, mb, side = r["model"], r.get("grad_accum"), r["side"]
        if not r.get("ok"):
            what = "refused" if r.get("refused") else "failed"
            lines.append(f"| {m} | {mb} | {side} | {what}: {r.get('error', '')[:90].replace('|', '/')} "
                         "| | | | | | | |")
            continue
        peer = side in ("transformers", "torchtitan", "torchtitan eager")
        fp8 = ok.get((m, mb, side.replace("+fp8", ""))) if "+fp8" in side else None
        bf16 = ok.get((m, mb, side + "+bf16")) if not peer and "bf16" not in side.split("+") else None
        hf = None if peer else ok.get((m, mb, "transformers"))
        tt = None if peer else ok.get((m, mb, "torchtitan")) or ok.get((m, mb, "torchtitan eager"))
        lines.append(f"| {m} | {mb} | {side} | {r['tokens_per_s'] / 1e3:.1f}K | {100 * r['mfu']:.1f}% | "
                     f"{r['peak_gb']:.1f} | {r['step_ms']:.1f} | {ratio(r, hf)} | {ratio(r, tt)} | "
                     f"{ratio(r, fp8)} | {ratio(r, bf16)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pithtrain.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated recipe names")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated variants (see above)")
    p.add_argument("--peers", default=",".join(PEERS),
                   help="comma-separated peers timed after each model's variants: transformers, torchtitan "
                        "(a row saying so when not installed); '' for none")
    p.add_argument("--fp8", action="store_true", help="also time the first variant with FP8 expert GEMMs")
    p.add_argument("--layers", type=int, default=12, help="decoder layers (docs/bench.md: 12, and 4)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--grad-accum", default="1,8",
                   help="comma-separated micro-batches per optimizer step, each a setting of its own")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--doc-len", type=int, default=0,
                   help="document masking (data.document_mask) on random documents of this mean length; "
                        "0: none. PithTrain's sides only (pass --peers '')")
    p.add_argument("--json", default="bench.json", help="where to write all records")
    p.add_argument("--profile", default=None, help="append a torch.profiler top-kernel table per side")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if args.fp8:  # the same step with FP8 expert GEMMs, timed in this run next to its bf16 twin
        variants.append(variants[0] + "+fp8")
    specs = {v: parse_variant(v) for v in variants}  # bad arguments stop here, before any timing
    peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    if any(x not in PEERS for x in peers):
        raise SystemExit(f"bench: unknown peers in {args.peers!r} (known: {', '.join(PEERS)})")
    try:
        accums = [int(a) for a in args.grad_accum.split(",") if a]
        assert accums and min(accums) >= 1
    except (ValueError, AssertionError):
        raise SystemExit(f"bench: --grad-accum takes positive integers, comma-separated, not {args.grad_accum!r}")
    if args.doc_len < 0 or args.doc_len and peers:
        raise SystemExit("bench: --doc-len takes a positive mean length and times PithTrain's sides only "
                         "(the peers' steps here have no document masking): add --peers ''")
    if args.warmup < 1:
        raise SystemExit("bench: --warmup must be at least 1 (the first step compiles and is timed apart)")
    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    alloc = cuda_allocator()
    device = torch.device("cuda")
    print(f"bench: {torch.cuda.get_device_name()} | torch {torch.__version__} | allocator {alloc} | {args.layers} "
          f"layers, {args.batch} x {args.seq}, {'/'.join(map(str, accums))} micro-batches per step, bf16, AdamW"
          + (f", documents of mean length {args.doc_len}" if args.doc_len else ""), flush=True)
    recs = []
    for name in [m for m in args.models.split(",") if m]:
        for accum in accums:
            cfg = bench_config(name, args.layers, args.batch, args.seq, accum)
            for v, spec in specs.items():
                recs.append(measure(name, v, cfg, lambda: pithtrain_step(cfg, spec, device, args.doc_len),
                                    args.warmup, args.steps, args.profile))
            recs += peer_sides(name, cfg, device, peers, args.warmup, args.steps, args.profile)
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "layers": args.layers, "doc_len": args.doc_len, "records": recs}, f, indent=1)
    print(table(recs), flush=True)
    return exit_status(recs, specs)


def exit_status(recs: list[dict], variants) -> int:
    """1 when a PithTrain side failed; a peer that fails and a side train.py would refuse (its
    memory plan) are rows, not a failed bench."""
    ours = [r for r in recs if r["side"] in variants and not r.get("refused")]
    return 0 if all(r.get("ok") for r in ours) else 1


if __name__ == "__main__":
    sys.exit(main())
