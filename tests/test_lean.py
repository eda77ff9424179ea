"""The lean training state (train.state=lean, pithtrain/precision.py) and FSDP's gathers kept across a
step (precision.keep): the split is exact, the update is the float32 update, the loss follows the
float32 loss within the spread of two float32 runs, checkpoints move between the states with the
masters bit for bit, and FSDP (gloo) keeps its layers gathered with the same numbers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from ranks import spawn
from test_distributed import FAMILIES, _init, free_port

from pithtrain.build import build_run, check_run
from pithtrain.config import ConfigError, config_from_dict, load_config
from pithtrain.data import build_batches
from pithtrain.distributed.parallel_dims import ParallelDims
from pithtrain.kernels.adamw import AdamW, join, join_, split
from pithtrain.models.common import local
from pithtrain.precision import LeanState, Precision
from pithtrain.train import micro_batches, train, train_step

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# The split and the update


@pytest.mark.quick
def test_split_is_exact_and_rounds_to_nearest_with_ties_away_from_zero():
    torch.manual_seed(0)
    x = torch.randn(1 << 18) * torch.logspace(-20, 20, 1 << 18)
    ties = (torch.randn(64).to(torch.bfloat16).float().view(torch.int32) | 0x8000).view(torch.float32)
    x = torch.cat([x, ties, torch.tensor([0.0, -0.0, 1.0, -1.0, 3.4e38, -1e-45])])
    hi, lo = split(x)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int16
    assert torch.equal(join(hi, lo).view(torch.int32), x.view(torch.int32))  # every bit back
    rne = x.to(torch.bfloat16)
    differ = hi.view(torch.int16) != rne.view(torch.int16)
    tie = lo == -(1 << 15)  # the low half of an exact tie: it rounded away from zero
    assert tie[differ].all() and differ.sum() >= 16 and (hi.float().abs() > x.abs())[tie].all()
    y = hi.float()  # a float32 tensor holding the high half (a lean checkpoint read into float32)
    assert torch.equal(join_(y, lo).view(torch.float32).view(torch.int32), x.view(torch.int32))


def _pair(seed: int = 0):
    """Two small modules with the same float32 weights (one tied pair, a 1-D parameter)."""
    torch.manual_seed(seed)
    ref = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 16, bias=False))
    ref[2].weight = ref[0].weight
    lean = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 16, bias=False))
    lean[2].weight = lean[0].weight
    lean.load_state_dict(ref.state_dict())
    return ref, lean


def _groups(model):
    params = list(model.parameters())
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


@pytest.mark.quick
def test_lean_update_is_the_float32_update_of_the_same_master_moments_and_gradient():
    """kernels/adamw.py on CPU (lean_update_): each step, torch.optim.AdamW in float32 given the lean
    master, the lean (bf16) moments upcast and the same gradient lands on exactly the joined halves
    of the lean step, and its moments round to the lean ones; the clip's factor folds in. The
    parameters stay bf16 and tied, and the float32 masters were taken apart exactly."""
    ref, model = _pair()
    lean = LeanState(accumulate=False)
    lean.convert(model)
    params = list(model.parameters())
    assert len(params) == 3 and all(p.dtype == torch.bfloat16 for p in params)
    assert model[2].weight is model[0].weight
    for p, q in zip(params, ref.parameters()):
        assert torch.equal(join(p.detach(), lean.lo(p)), q.detach())
    opt = AdamW(_groups(model), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, lean=lean)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for step in range(4):
        scale = 0.5 if step == 2 else 1.0
        for p, q in zip(params, ref.parameters()):
            p.grad = torch.randn_like(p)  # bf16, as autograd makes it for a bf16 parameter
            q.grad = p.grad.float() * scale
            if step:  # the float32 step starts from the lean moments
                for k in ("exp_avg", "exp_avg_sq"):
                    ref_opt.state[q][k].copy_(opt.state[p][k])
        opt.step(grad_scale=scale)
        ref_opt.step()
        for p, q in zip(params, ref.parameters()):
            assert torch.equal(join(p.detach(), lean.lo(p)).view(torch.int32), q.detach().view(torch.int32))
            for k in ("exp_avg", "exp_avg_sq"):
                assert opt.state[p][k].dtype == torch.bfloat16
                assert torch.equal(opt.state[p][k], ref_opt.state[q][k].to(torch.bfloat16))
        opt.zero_grad()
        ref_opt.zero_grad()


@pytest.mark.quick
def test_gradients_of_several_micro_batches_accumulate_in_float32():
    """LeanState with accumulate: each micro-batch's bf16 gradient is added into a float32 buffer (the
    hook), which the norm and AdamW read (Precision.grads) and zero_grad drops; the in-place weight
    gradient (kernels/wgrad.py's embedding) writes the buffer itself: fresh on the first, added later."""
    from pithtrain.kernels import wgrad

    _, model = _pair()
    precision = Precision(torch.bfloat16, "cpu", state="lean", accumulate=True)
    lean = precision.lean
    lean.convert(model)
    emb, norm = model[0].weight, model[1].weight
    ids = [torch.randint(0, 16, (4, 5)) for _ in range(3)]
    each = []
    for x in ids:
        h = wgrad.embedding(x, emb, copies=precision.sink)  # the in-place path, as use_kernels binds it
        g = torch.randn(4, 5, 8, dtype=torch.bfloat16)
        (model[1](h) * g).sum().backward()
        assert emb.grad is None and norm.grad is None  # both went into the buffers
        each.append(torch.autograd.grad((model[1](torch.nn.functional.embedding(x, emb)) * g).sum(), [norm])[0])
    assert emb.wgrad_adds == 3
    assert lean.grad(norm).dtype == torch.float32
    torch.testing.assert_close(lean.grad(norm), sum(e.float() for e in each), rtol=0, atol=0)
    assert len(precision.grads(model.parameters())) == 3 and lean.grad(emb).dtype == torch.float32
    AdamW(_groups(model), lean=lean).zero_grad()
    assert lean.grad(norm) is None and lean.grad(emb) is None


@pytest.mark.quick
def test_lean_needs_bf16_compute_and_a_beta2_its_moment_follows(tmp_path):
    """train.state=lean refuses float32 compute (train.dtype=float32 in the recipe; CPU's auto at
    start-up: build.check_run) and a beta2 whose bf16 second moment would stop decaying."""
    with pytest.raises(ConfigError, match="train.state: lean keeps bf16 weights"):
        load_config(None, ["train.state=lean", "train.dtype=float32"])
    with pytest.raises(ConfigError, match="train.beta2: 0.999 is above 0.99"):
        load_config(None, ["train.state=lean", "train.dtype=bfloat16", "train.beta2=0.999"])
    with pytest.raises(ConfigError, match="train.state: lean keeps bf16 weights and needs bf16 compute"):
        check_run(load_config(None, ["train.state=lean"]), CPU, 1)
    cfg = load_config(None, ["train.state=lean", "train.dtype=bfloat16", "train.grad_accum=2"])
    check_run(cfg, CPU, 1)
    p = Precision.of(cfg.train, CPU, ParallelDims())
    assert (p.compute, p.copies, p.lean.accumulate) == (torch.bfloat16, None, True)
    assert p.bytes_per_param() == {"weights": 4, "grads": 4, "optimizer": 4, "copy": 0}
    cfg.train.grad_accum = 1
    assert Precision.of(cfg.train, CPU, ParallelDims()).bytes_per_param()["grads"] == 2


# ---------------------------------------------------------------------------------------------
# Numerics: the lean curve against the spread of two float32 runs


TINY = ["train.dtype=bfloat16", "train.micro_batch_size=4", "train.seq_len=32", "train.lr=1e-4",
        "train.warmup_steps=5", "train.lr_schedule=constant", "model.hidden_size=32", "model.num_heads=4",
        "model.head_dim=8", "model.num_kv_heads=2", "model.moe_intermediate_size=16", "model.num_layers=2",
        "data.max_bytes=100000"]


def _curve(state: str, data_seed: int, steps: int = 60) -> list[float]:
    """Loss on two fixed held-out batches after each step: the recipe's seed draws the weights,
    `data_seed` the order of the training batches (bf16 compute on CPU, one thread)."""
    cfg = load_config(None, TINY + [f"train.state={'float32' if state == 'bf16' else state}"])
    t = cfg.train
    torch.manual_seed(t.seed)
    run = build_run(cfg, CPU, ParallelDims(), state=state)
    batches = build_batches(cfg.data, t.seq_len, t.micro_batch_size, data_seed)
    held = [build_batches(cfg.data, t.seq_len, t.micro_batch_size, 999).batch(i) for i in range(2)]
    out = []
    for step in range(steps):
        x, y = batches.batch(step)
        train_step(run, micro_batches(run, batches, x, y), (y != -100).sum().item(), step)
        with torch.no_grad(), run.precision.weights(run.model), run.precision.autocast():
            out.append(sum(run.model(x, labels_BS=y).item() / (y != -100).sum().item() for x, y in held) / 2)
    return out


def test_lean_loss_follows_float32_within_the_spread_of_two_float32_runs():
    """A fixed problem (a tiny Qwen3-MoE, 60 AdamW steps at lr 1e-4, bf16 compute): the spread is the
    largest gap between two float32 runs from the same weights whose batches come in another order
    (seeds 1 and 2); the lean run of seed 1 must stay closer than that to the float32 run of seed 1
    at every step (measured: spread 8.9e-3, lean 1.3e-4). The test can fail: the bf16 state, the
    same update without the masters' low halves, drifts past the spread (2.6e-2)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b, lean, bf16 = _curve("float32", 1), _curve("float32", 2), _curve("lean", 1), _curve("bf16", 1)
    finally:
        torch.set_num_threads(threads)
    spread = max(abs(x - y) for x, y in zip(a, b))
    drift = max(abs(x - y) for x, y in zip(a, lean))
    assert a[-1] < a[0] - 0.2  # it learns
    assert drift < spread / 10, (drift, spread)
    assert max(abs(x - y) for x, y in zip(a, bf16)) > spread


# ---------------------------------------------------------------------------------------------
# Checkpoints: either state resumes either


def _masters(model, lean: LeanState | None) -> dict[str, torch.Tensor]:
    return {n: (join(p.detach(), lean.lo(p)) if lean else p.detach()).clone() for n, p in model.named_parameters()}


def test_checkpoints_resume_across_states_with_the_masters_bit_for_bit(tiny_overrides, tmp_path, capsys,
                                                                       monkeypatch):
    """A lean checkpoint resumes a float32 run, a float32 checkpoint a lean one: the masters equal the
    saving run's bit for bit, the moments are cast; trainer.json records the state; export (and
    load_model_weights) join a lean checkpoint's halves; and training goes on from there."""
    from safetensors.torch import load_file

    from pithtrain.checkpoint.export import export, load_checkpoint_model
    base = [o for o in tiny_overrides if not o.startswith("train.steps")] + [
        "train.dtype=bfloat16", "train.steps=2", "checkpoint.every=2", "data.max_bytes=100000"]

    def run(state, run_dir, resume=False, steps=2):
        cfg = load_config(None, base + [f"train.state={state}", f"log.run_dir={tmp_path / run_dir}",
                                        f"train.steps={steps}"])
        captured, real = {}, Precision.of

        def spy(*a, **k):  # the run's precision, to read its lean halves
            captured["p"] = real(*a, **k)
            return captured["p"]
        monkeypatch.setattr(Precision, "of", spy)
        _, model = train(cfg, resume=resume)
        monkeypatch.undo()
        return model, captured["p"].lean

    lean_model, lean = run("lean", "a")
    saved = tmp_path / "a/checkpoints/step_2"
    assert json.loads((saved / "trainer.json").read_text())["state"] == "lean"
    want = _masters(lean_model, lean)
    f32_model, none = run("float32", "b", resume=str(saved))
    out = capsys.readouterr().out
    assert none is None and "holds the lean training state" in out
    assert "pithtrain: precision: compute bfloat16, state lean (4 + 2 + 4 B per parameter" in out  # start-up
    got = _masters(f32_model, None)
    assert all(torch.equal(got[n].view(torch.int32), want[n].view(torch.int32)) for n in want)
    assert all(torch.equal(load_checkpoint_model(saved).state_dict()[n], want[n]) for n in want)
    export(saved, tmp_path / "hf", torch.float32)
    hub = load_file(tmp_path / "hf/model.safetensors")
    assert torch.equal(hub["model.norm.weight"], want["norm.weight"])

    f32_model, _ = run("float32", "c")
    want = _masters(f32_model, None)
    lean_model, lean = run("lean", "d", resume=str(tmp_path / "c/checkpoints/step_2"), steps=3)  # and a step on
    lean_model2, lean2 = run("lean", "e", resume=str(tmp_path / "c/checkpoints/step_2"))
    got = _masters(lean_model2, lean2)
    assert all(torch.equal(got[n].view(torch.int32), want[n].view(torch.int32)) for n in want)
    assert all(p.dtype == torch.bfloat16 for p in lean_model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(_masters(lean_model, lean).values(), got.values()))


# ---------------------------------------------------------------------------------------------
# FSDP (gloo, 2 ranks): lean, and the gathers kept across a step


def _fsdp_cfg(tmp: str, state: str, dtype: str, fsdp: int = 2, grad_accum: int = 2):
    return config_from_dict({
        "model": dict(FAMILIES["qwen3_moe"]),
        "train": dict(steps=3, micro_batch_size=2, seq_len=16, grad_accum=grad_accum, warmup_steps=1, device="cpu",
                      dtype=dtype, state=state),
        "data": dict(max_bytes=20000), "parallel": dict(fsdp=fsdp) if fsdp > 1 else {},
        "checkpoint": dict(final=False), "log": dict(every=1, run_dir=tmp)})


def _steps(cfg, dims, keep, gathers: list, n: int = 2) -> dict:
    """n train steps of a fresh build; the losses, norms, final local parameters (float32 masters,
    lean's joined) and the all-gathers FSDP issued per step."""
    torch.manual_seed(cfg.train.seed)
    run = build_run(cfg, CPU, dims, keep=keep)
    t = cfg.train
    batches = build_batches(cfg.data, t.seq_len, t.micro_batch_size * t.grad_accum * dims.data_parallel_size, t.seed)
    out = {"loss": [], "gnorm": [], "gathers": []}
    for step in range(n):
        x, y = batches.batch(step)
        before = len(gathers)
        done = train_step(run, micro_batches(run, batches, x, y), (y != -100).sum().item(), step)
        out["loss"].append(done.loss)
        out["gnorm"].append(done.grad_norm)
        out["gathers"].append(len(gathers) - before)
    lean = run.precision.lean
    out["params"] = {k: (join(local(p).detach(), local(lean.lo(p))) if lean else local(p).detach()).clone()
                     for k, p in run.model.named_parameters()}
    out["run"] = run
    return out


def _across_states(run, masters: dict, dims, run_dir: str) -> list[bool]:
    """The lean FSDP run's checkpoint resumes a float32 FSDP run, whose checkpoint resumes a lean
    one: each time, every rank's shard of every master bit for bit."""
    from pithtrain.checkpoint.dcp import Checkpointer

    def same(built):
        lean = built.precision.lean
        return all(torch.equal((join(local(p).detach(), local(lean.lo(p))) if lean else local(p).detach())
                               .view(torch.int32), masters[k].view(torch.int32))
                   for k, p in built.model.named_parameters())
    out, saving = [], run
    for step, state in ((2, "float32"), (3, "lean")):
        cfg = _fsdp_cfg(run_dir, saving.precision.state, "bfloat16")
        Checkpointer(cfg, saving.model, saving.optimizer, saving.scheduler, CPU, saving.precision).save(step)
        cfg = _fsdp_cfg(run_dir, state, "bfloat16")
        built = build_run(cfg, CPU, dims)
        Checkpointer(cfg, built.model, built.optimizer, built.scheduler, CPU, built.precision).load(
            Path(run_dir) / f"checkpoints/step_{step}")
        out.append(built.precision.state == state and same(built))
        saving = built
    return out


def _fsdp_worker(rank: int, world: int, port: int, tmp: str):
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    dist = _init(rank, world, port)
    gathers, real = [], _fsdp_param_group.foreach_all_gather

    def counted(fsdp_params, *a, **k):  # the witness: every all-gather FSDP issues
        gathers.append(len(fsdp_params))
        return real(fsdp_params, *a, **k)
    _fsdp_param_group.foreach_all_gather = counted
    report = {}
    for state, dtype in (("float32", "float32"), ("lean", "bfloat16")):
        cfg = _fsdp_cfg(os.path.join(tmp, f"r{rank}"), state, dtype)
        dims = check_run(cfg, CPU, world, rank).init(CPU, cfg.parallel.timeout_s)
        kept, fresh = _steps(cfg, dims, True, gathers), _steps(cfg, dims, False, gathers)
        run = kept["run"]
        r = report[state] = {
            "same": all(torch.equal(kept["params"][k], fresh["params"][k]) for k in kept["params"])
            and kept["loss"] == fresh["loss"] and kept["gnorm"] == fresh["gnorm"],
            "gathers": [kept["gathers"], fresh["gathers"]], "kept": len(run.precision.kept),
            "layers": cfg.model.num_layers, "loss": kept["loss"], "gnorm": kept["gnorm"]}
        if state == "lean":  # the sharded parameters are bf16, gathered without a cast
            groups = [m._get_fsdp_state()._fsdp_param_group for m in run.precision.kept]
            r["no_cast"] = all(fp.param_dtype is None and fp.sharded_param.dtype == torch.bfloat16
                               for g in groups for fp in g.fsdp_params)
            with run.precision.weights(run.model):  # two micro-batches' gradients: float32 on the shards
                for x, y, pos, docs in micro_batches(run, None, *build_batches(
                        cfg.data, 16, 8, 7).batch(0))[:2]:
                    with run.precision.autocast():
                        run.model(x, positions_BS=pos, labels_BS=y).backward()
            grads = run.precision.grads(run.model.parameters())
            r["float32_shards"] = bool(grads) and all(g.dtype == torch.float32 and hasattr(g, "to_local")
                                                      for g in grads)
            r["across_states"] = _across_states(run, kept["params"], dims, os.path.join(tmp, "ckpt"))
            if rank == 0:  # one process, the same global batch in 4 micro-batches
                one = _steps(_fsdp_cfg(os.path.join(tmp, "one"), state, dtype, fsdp=1, grad_accum=4),
                             ParallelDims(), None, [])
                r["one_loss"], r["one_gnorm"] = one["loss"], one["gnorm"]
    if rank == 0:
        with open(os.path.join(tmp, "fsdp.json"), "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


def test_fsdp_keeps_layers_gathered_with_the_same_numbers_and_gathers_lean_without_a_cast(tmp_path):
    """fsdp=2, 2 micro-batches a step, float32 and lean: keeping each decoder layer gathered across
    the step (precision.keep) gives bit-identical losses, norms and parameters to gathering per
    micro-batch, and the witness: the layers' all-gathers per step fall from 2 per micro-batch
    (forward, backward) to 1 (the experts' and the root's units are unchanged: 2 + 2 x 2 per step
    of 2 layers, 2 micro-batches). Lean: FSDP's sharded parameters are bf16 and gathered with no
    cast, two micro-batches' gradients sum in float32 DTensor buffers, and the step matches one
    process's lean step of the same global batch (first-step loss as computed, up to the order of
    its sums; norm within bf16's rounding of the reduced gradient)."""
    spawn(_fsdp_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    report = json.loads((tmp_path / "fsdp.json").read_text())
    for state, r in report.items():
        assert r["same"], state
        assert r["kept"] == r["layers"] == 2
        kept, fresh = r["gathers"]
        layers, micro = r["layers"], 2
        assert [f - k for k, f in zip(kept, fresh)] == [layers * (2 * micro - 1)] * 2, r["gathers"]
    lean = report["lean"]
    assert lean["no_cast"] and lean["float32_shards"] and lean["across_states"] == [True, True]
    print({k: (lean[k], lean[f"one_{k}"]) for k in ("loss", "gnorm")})
    assert lean["loss"][0] == pytest.approx(lean["one_loss"][0], rel=1e-5)
    assert lean["gnorm"][0] == pytest.approx(lean["one_gnorm"][0], rel=1e-2)
    assert lean["loss"][1] == pytest.approx(lean["one_loss"][1], rel=1e-3)


# ---------------------------------------------------------------------------------------------
# The memory plan


def test_the_plan_counts_the_lean_bytes_and_keeps_layers_gathered_only_where_that_fits():
    """Qwen3-30B-A3B at fsdp=8 ep=8 with train.state=lean: 4 + 2 + 4 B per parameter (one micro-batch)
    and no bf16 copy, where float32 keeps 4 + 4 + 8 and a copy of its experts; the dense layers kept
    gathered are counted (`keep_bytes`), and on a GPU where only the plan without them fits the
    plan drops them (`keep` false: the run gathers per micro-batch)."""
    from test_plan import qwen3_rank

    from pithtrain import plan as planner
    one = ["parallel.auto=false", "parallel.fsdp=8", "parallel.ep=8", "train.activation_checkpoint=full",
           "train.global_batch_tokens=null"]
    cfg = load_config("qwen3-30b-a3b", one + ["train.state=lean"])
    n = qwen3_rank(cfg.model, 1)[0]
    r = (result := planner.plan(cfg, 8, 1000.0, "h200"))["ranks"][0]
    assert (r["params"], r["grads"], r["optimizer"], r["bf16_copy"]) == (4 * n, 2 * n, 4 * n, 0)
    assert result["keep"] and r["keep"] and r["keep_bytes"] > 0
    f32 = planner.plan(load_config("qwen3-30b-a3b", one), 8, 1000.0, "h200")["ranks"][0]
    assert (f32["grads"], f32["optimizer"]) == (4 * n, 8 * n) and f32["bf16_copy"] > 0
    tight = (r["peak"] - r["keep_bytes"] / 2) / 2**30 / planner.FIT_FRACTION
    dropped = planner.plan(cfg, 8, tight, "h200")
    assert dropped["fits"] and dropped["keep"] is False
    assert dropped["ranks"][0]["peak"] == r["peak"] - r["keep_bytes"]
