"""The memory plan (pithtrain/plan.py), `parallel: auto`, and FSDP's mixed-precision policy.

CPU tests: each family's real recipe at its real widths on the meta device (nothing is allocated);
the planner's parameter, gradient and optimizer bytes equal arithmetic written here from the
config for one layout per family (FSDP, HSDP, pipeline x FSDP x EP). The GPU test (marked gpu)
runs the bench configurations and the default recipe through train.py and compares the planned
peak with torch.cuda.max_memory_allocated (within 10%): `python -m pytest -m gpu tests/test_plan.py -s`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ranks import spawn

from pithtrain import perf
from pithtrain import plan as planner
from pithtrain.config import ConfigError, load_config
from pithtrain.gpus import GPUS

REPO = Path(__file__).resolve().parent.parent


def qwen3_rank(m, ranks):
    """Qwen3-MoE, fsdp=8 ep=8: every dense tensor split 8 ways on dim 0, 128/8 whole experts each."""
    D, H, K, hd, E, F, L, V = (m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.num_experts,
                               m.moe_intermediate_size, m.num_layers, m.vocab_size)
    layer = 2 * D * H * hd + 2 * D * K * hd + 2 * hd + 2 * D + D * E
    return [(2 * V * D + D + L * layer) // 8 + L * (E // 8) * 3 * D * F] * ranks


def deepseek_rank(m, ranks):
    """DeepSeek-V2-Lite, dp=2 fsdp=4 ep=4 (HSDP): dense split 4 ways and replicated over dp;
    64/4 whole experts per rank."""
    D, H, C, R, N, e = (m.hidden_size, m.num_heads, m.kv_lora_rank, m.qk_rope_head_dim,
                        m.qk_nope_head_dim, m.v_head_dim)
    attn = D * H * (N + R) + D * (C + R) + C + C * H * (N + e) + H * e * D + 2 * D
    dense = attn + 3 * D * m.intermediate_size
    moe = attn + D * m.num_experts + 3 * D * m.n_shared_experts * m.moe_intermediate_size
    k = m.first_k_dense_replace
    dense_total = 2 * m.vocab_size * D + D + k * dense + (m.num_layers - k) * moe
    experts = (m.num_layers - k) * (m.num_experts // 4) * 3 * D * m.moe_intermediate_size
    return [dense_total // 4 + experts] * ranks


def gpt_oss_rank(m, ranks):
    """GPT-OSS-20B, pp=2 fsdp=4 ep=2: 12 layers per stage, the embedding on stage 0, norm and
    head on stage 1; dense split 4 ways; experts 32/2 per ep rank, split 2 ways on dim 1."""
    D, H, K, hd, E, F, V = (m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.num_experts,
                            m.intermediate_size, m.vocab_size)
    dense = (D * H * hd + H * hd) + 2 * (D * K * hd + K * hd) + (H * hd * D + D) + H + 2 * D + D * E + E
    experts = E * (D * 2 * F + 2 * F + F * D + D)
    layers = 12 * (dense // 4 + experts // 4)
    return [V * D // 4 + layers, (V * D + D) // 4 + layers]


CASES = {
    "qwen3-30b-a3b": (["parallel.fsdp=8", "parallel.ep=8"], qwen3_rank, 1),
    "deepseek-v2-lite": (["parallel.dp=2", "parallel.fsdp=4", "parallel.ep=4"], deepseek_rank, 1),
    "gpt-oss-20b": (["parallel.pp=2", "parallel.fsdp=4", "parallel.ep=2", "train.grad_accum=2"],
                    gpt_oss_rank, 2),
}


@pytest.mark.parametrize("recipe", list(CASES))
def test_plan_bytes_equal_arithmetic(recipe):
    overrides, hand, stages = CASES[recipe]
    cfg = load_config(recipe, ["parallel.auto=false", "train.activation_checkpoint=none", *overrides])
    result = planner.plan(cfg, 8, GPUS["h200"].memory_gib, "h200")
    want = hand(cfg.model, stages)
    got = [(r["stage"], r["params"], r["grads"], r["optimizer"]) for r in result["ranks"]]
    assert got == [(s, 4 * n, 4 * n, 8 * n) for s, n in enumerate(want)], (got, want)
    assert [r["rank"] for r in result["ranks"]] == [s * 8 // stages for s in range(stages)]


def test_fsdp_traffic_before_and_after_policy():
    """qwen3 fsdp=8 ep=8: experts are whole per rank (no FSDP traffic); per micro-batch the root
    (embedding, norm, head) is gathered once, each layer's dense tensors twice, all reduced once;
    a ring moves 7/8 of each buffer. float32 gathers (4 B) vs the policy's bf16 (2 B)."""
    cfg = load_config("qwen3-30b-a3b", ["parallel.auto=false", "parallel.fsdp=8", "parallel.ep=8",
                                        "train.activation_checkpoint=full"])
    m = cfg.model
    D, H, K, hd, E = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.num_experts
    root, layers = 2 * m.vocab_size * D + D, m.num_layers * (2 * D * H * hd + 2 * D * K * hd + 2 * hd + 2 * D + D * E)
    traffic = planner.plan(cfg, 8, 80.0)["ranks"][0]["fsdp_bytes_per_step"]
    for key, gather in (("float32", 4), ("policy", 2)):
        want = 7 / 8 * (root * (gather + 4) + layers * (2 * gather + 4))
        assert traffic[key] == pytest.approx(want, rel=1e-9), key
    assert traffic["policy"] < 0.7 * traffic["float32"]


@pytest.mark.parametrize("recipe,gpu", [("qwen3-30b-a3b", "h100"), ("deepseek-v2-lite", "h100"),
                                        ("gpt-oss-20b", "b200")])
def test_plan_cli_fits_on_eight_not_on_one(recipe, gpu, capsys):
    """The shipped recipes (`parallel: auto`) fit on 8 GPUs; the full models do not fit on one, and
    then the plan exits 1 naming the nearest setting that fits."""
    for gpus, fits in (("8", True), ("1", False)):
        assert planner.main(["--model", recipe, "--gpu", gpu, "--gpus", gpus, "--json"]) == (0 if fits else 1)
        cap = capsys.readouterr()
        out = json.loads(cap.out)
        assert set(out["layout"]) == {"pp", "dp", "fsdp", "cp", "ep"}
        assert out["fits"] is fits and out["gpu_gib"] == GPUS[gpu].memory_gib
        assert (out["peak_gib"] <= planner.FIT_FRACTION * out["gpu_gib"]) is fits
        ranked = [c["prediction"]["tokens_per_s_per_gpu"] for c in out["candidates"]]
        assert all(b <= a * (1 + planner.TIE) for a, b in zip(ranked, ranked[1:]))  # fastest first, but ties
        if fits:
            assert out["layout"]["fsdp"] * out["layout"]["pp"] * out["layout"]["dp"] == 8
            assert out["prediction"]["tokens_per_s_per_gpu"] > 0 and cap.err == ""
            c, dp = out["choice"], out["layout"]["dp"] * out["layout"]["fsdp"]  # the recipe's step, as chosen
            assert c["micro_batch_size"] * c["grad_accum"] * dp * 4096 == out["global_batch_tokens"] == 524288
        else:
            assert out["peak_gib"] > 100  # params + grads + AdamW alone: 16 B x >= 15.7B parameters
            assert "does not fit" in cap.err
            assert re.search(r"nearest that fits: --set parallel.auto=true on [248] GPUs fits", cap.err)


def test_invoke_plan_prints_the_table():
    r = subprocess.run([sys.executable, "-m", "invoke", "plan", "--model=deepseek-v2-lite", "--gpu=h100",
                        "--gpus=8"], cwd=REPO, text=True, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "pp=8 dp=1 fsdp=1 cp=1 ep=1" in r.stdout and "fits: yes" in r.stdout
    assert "choice: the fastest of" in r.stdout and re.search(r"^> pp=8 dualpipev +none +1 x 128 .* chosen$",
                                                              r.stdout, re.M)


# ---------------------------------------------------------------------------------------------
# parallel: auto


@pytest.mark.quick
def test_auto_fills_unset_sizes_and_keeps_given_ones():
    """Resolution is a pure function: it returns the layout (and a new Config with it); the
    recipe's Config keeps its unset sizes."""
    cfg = load_config("qwen3-30b-a3b")
    assert cfg.parallel.auto and cfg.parallel.fsdp is None
    fastest = planner.ranked(cfg, 8, "h200")[0]
    lay, result = planner.auto_layout(cfg, 8, None)  # no GPU memory: nothing planned, the fastest taken
    assert result is None and lay == planner.choice_of(fastest)
    resolved, result = planner.resolve(cfg, 8)
    assert result is None and resolved.model is cfg.model
    assert planner.choice_of({**vars(resolved.parallel), **vars(resolved.train)}) == lay
    assert cfg.parallel.fsdp is None  # ranking and resolving leave the recipe's sizes as they were

    def sizes(c, world=8):
        return [getattr(planner.resolve(c, world)[0].parallel, k) for k in ("pp", "dp", "fsdp", "cp", "ep")]
    assert sizes(load_config("qwen3-30b-a3b", ["parallel.ep=2", "parallel.cp=2", "train.compile=false"]))[3:] == [2, 2]
    pp, dp, fsdp = sizes(load_config("deepseek-v2-lite", ["parallel.fsdp=4"]))[:3]
    assert fsdp == 4 and pp * dp == 2  # fsdp given: pp and dp the rest
    cfg = load_config("gpt-oss-20b", ["parallel.ep=3"])  # a given size that cannot work
    with pytest.raises(ConfigError, match="parallel: auto found no valid layout"):
        planner.auto_layout(cfg, 8, None)


def test_auto_chooses_recomputation_and_batch_for_the_global_batch():
    """With train.global_batch_tokens and activation_checkpoint: auto, auto chooses the layout, the
    recomputation, the micro-batch and the accumulation together: the chosen one fits and makes the
    recipe's step; every candidate ranked faster does not fit (planned, or its bound over the GPU);
    the recipe's Config is left as it was."""
    cfg = load_config("deepseek-v2-lite", ["parallel.pp=1"])
    resolved, result = planner.resolve(cfg, 8, "h100", GPUS["h100"].memory_gib)
    t, usable = resolved.train, result["usable_gib"]
    assert cfg.train.activation_checkpoint == "auto" and cfg.train.micro_batch_size == 2 and cfg.parallel.fsdp is None
    assert t.activation_checkpoint in planner.POLICIES and result["fits"]
    dp = resolved.parallel.dp * resolved.parallel.fsdp
    assert t.micro_batch_size * t.grad_accum * dp * t.seq_len == t.global_batch_tokens == 524288
    options = result["candidates"]
    at = next(i for i, c in enumerate(options) if planner.choice_of(c) == result["choice"])
    assert {(c["activation_checkpoint"], c["micro_batch_size"]) for c in options} >= {("full", 1), ("none", 16)}
    for c in options[:at]:
        assert c["fits"] is False and max(c.get("peak_gib", 0), c.get("peak_floor_gib", 0)) > usable, c
    assert planner.choice_of({**vars(resolved.parallel), **vars(t)}) == result["choice"]


def test_the_bound_is_below_the_plan():
    """floor_gib, which skips a candidate without building its model, is a lower bound of its plan:
    every policy, a pipeline (each stage) and FSDP layouts, several micro-batches."""
    from pithtrain.models import build_model
    from pithtrain.models.common import decoder_layers

    cfg = load_config("deepseek-v2-lite", ["parallel.auto=false", "train.global_batch_tokens="])
    layers = decoder_layers(build_model(cfg.model, init=False))
    per_token = {p: {i: sum(planner.layer_activations(x, i, cfg, 2, p)) for i, x in enumerate(layers)}
                 for p in planner.POLICIES}
    models = {}
    for lay in (["parallel.fsdp=8", "parallel.ep=8"], ["parallel.pp=2", "parallel.fsdp=4", "parallel.ep=4"]):
        for policy, mb in (("none", 2), ("cheap", 1), ("selective", 4), ("full", 8)):
            c = load_config("deepseek-v2-lite", [
                "parallel.auto=false", "train.global_batch_tokens=", *lay, f"train.activation_checkpoint={policy}",
                f"train.micro_batch_size={mb}", "train.grad_accum=4"])
            peak = planner.plan(c, 8, 80.0, "h100", models=models)["peak_gib"]
            assert 0.5 * peak < planner.floor_gib(c, 8, per_token) <= peak, (lay, policy, mb)


def test_a_given_layout_must_make_the_global_batch():
    """train.global_batch_tokens with the layout given: micro-batch x accumulation x data-parallel
    ranks x sequence must be it, else one line that says which accumulation would be; the field
    itself must be a multiple of the sequence."""
    base = ["parallel.auto=false", "parallel.fsdp=8", "parallel.ep=8", "train.activation_checkpoint=full"]
    with pytest.raises(ConfigError) as e:
        planner.resolve(load_config("qwen3-30b-a3b", base), 8)
    msg = str(e.value)
    assert "\n" not in msg and "train.global_batch_tokens: 524288 is not micro_batch_size x grad_accum x " \
        "data-parallel ranks x seq_len = 2 x 1 x 8 x 4096 = 65536; set train.grad_accum=8" in msg
    cfg = load_config("qwen3-30b-a3b", [*base, "train.grad_accum=8"])
    assert planner.resolve(cfg, 8)[0] is cfg
    with pytest.raises(ConfigError, match="train.global_batch_tokens: must be a positive multiple of train.seq_len"):
        load_config("qwen3-30b-a3b", ["train.global_batch_tokens=1000"])


def test_auto_without_costs_for_the_family_chooses_by_memory_and_says_so(monkeypatch, capsys, tmp_path):
    """`parallel: auto` for a family the cost file has not measured (a new family, say): the
    layout with the fewest parameters per rank, one line saying so, no KeyError from perf.predict;
    on CPU, through train.py itself."""
    from pithtrain import perf
    from pithtrain.train import train
    costs = perf.load_costs()
    monkeypatch.setattr(perf, "load_costs", lambda path=None: {**costs, "families": {
        k: v for k, v in costs["families"].items() if k != "qwen3_moe"}})
    cfg = load_config(None, ["parallel.auto=true"])  # the tiny Qwen3
    options = planner.ranked(cfg, 4, "h200")
    assert all(c["prediction"] is None for c in options)
    params = [perf.local_params(cfg, c) for c in options]
    assert params == sorted(params) and params[0] < params[-1]
    lay, _ = planner.auto_layout(cfg, 4, None)
    assert lay == planner.choice_of(options[0]) and lay["fsdp"] * lay["ep"] > 1
    line = planner.launch_line(planner.resolve(cfg, 4)[0], None)
    assert "\n" not in line and "chosen by memory alone" in line and "'qwen3_moe'" in line
    cfg = load_config(None, ["parallel.auto=true", "train.steps=1", "checkpoint.final=false", "model.num_layers=1",
                             "train.micro_batch_size=2", "train.seq_len=32", f"log.run_dir={tmp_path}"])
    train(cfg)
    assert "pithtrain: parallel auto: pp=1 dp=1 fsdp=1 cp=1 ep=1 (no GPU memory to plan against; chosen by " \
           "memory alone" in capsys.readouterr().out


def test_auto_yaml_forms(tmp_path):
    base = "model: {family: qwen3_moe}\n"
    for text, ep in (("parallel: auto\n", None), ("parallel: {auto: true, ep: 2}\n", 2)):
        (tmp_path / "r.yaml").write_text(base + text)
        p = load_config(tmp_path / "r.yaml").parallel
        assert p.auto and p.ep == ep and p.fsdp is None
    (tmp_path / "r.yaml").write_text(base + "parallel: {auto: true, epp: 2}\n")
    with pytest.raises(ConfigError, match="parallel.epp: unknown key"):
        load_config(tmp_path / "r.yaml")
    assert load_config(None).parallel.fsdp == 1  # without auto an unset size is 1


def test_cuda_launch_refuses_a_plan_that_does_not_fit(monkeypatch):
    """train.py's start on a (faked) 80 GiB GPU: the layout resolved against it (plan.resolve_launch),
    then build.check_run: one process cannot hold Qwen3-30B-A3B; the error is one line with the
    overshoot and what to change; `parallel: auto` on 8 fits and rank 0's line says its layout."""
    from pithtrain.build import check_run
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(total_memory=int(79.6 * planner.GIB)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    cfg, result = planner.resolve_launch(load_config("qwen3-30b-a3b", ["parallel.auto=false",
                                                                       "train.global_batch_tokens="]), cuda, 1)
    with pytest.raises(ConfigError) as e:
        check_run(cfg, cuda, 1, 0, result)
    msg = str(e.value)
    assert "\n" not in msg and "does not fit" in msg and "over by" in msg and "more GPUs than 1" in msg
    assert "parallel: auto" in msg
    cfg, result = planner.resolve_launch(load_config("qwen3-30b-a3b"), cuda, 8)
    assert result["fits"]
    lay = " ".join(f"{k}={getattr(cfg.parallel, k)}" for k in ("pp", "dp", "fsdp", "cp", "ep"))
    t = cfg.train
    line = planner.launch_line(cfg, result)
    assert line.startswith(f"pithtrain: parallel auto: {lay}, activation_checkpoint={t.activation_checkpoint} "
                           f"micro_batch_size={t.micro_batch_size} grad_accum={t.grad_accum} (memory plan: peak")
    assert "tokens/s per GPU (pithtrain/perf.py), the fastest of" in line


# ---------------------------------------------------------------------------------------------
# Mixed precision


def test_fsdp_modules_carry_the_mixed_precision_policy():
    from torch.distributed.fsdp import FSDPModule

    from pithtrain.distributed.parallel_dims import ParallelDims
    from pithtrain.distributed.parallelize import parallelize
    from pithtrain.models import build_model
    from pithtrain.precision import Precision

    cfg = load_config(None, ["parallel.fsdp=2", "parallel.ep=2", "train.reduce_dtype=float32"])
    t, dims = cfg.train, ParallelDims(fsdp=2, ep=2)
    assert Precision.of(t, torch.device("cpu"), dims).fsdp_policy().param_dtype == torch.float32  # CPU: parity
    assert Precision.of(t, torch.device("cuda"), dims).fsdp_policy().param_dtype == torch.bfloat16
    assert Precision.of(t, torch.device("cuda"), dims).fsdp_policy().reduce_dtype == torch.float32
    t.reduce_dtype = "bfloat16"
    assert Precision.of(t, torch.device("cuda"), dims).fsdp_policy().reduce_dtype == torch.bfloat16
    # fsdp=2 ep=2: each rank's experts are its own (efsdp = edp = 1), so FSDP leaves them out;
    # fsdp=4 ep=2 shards them over 2 ranks (efsdp = 2): each layer's experts are an FSDP module
    from pithtrain.models.common import GroupedExperts
    for world, experts_sharded in ((2, False), (4, True)):
        cfg = load_config(None, [f"parallel.fsdp={world}", "parallel.ep=2", "train.reduce_dtype=bfloat16"])
        dims = ParallelDims.from_config(cfg, world, 0)
        assert dims.experts_alone is not experts_sharded
        with planner.fake_world(world, 0):
            dims.build_meshes("cpu")
            model = parallelize(build_model(cfg.model, init=False), dims, cfg.train, torch.device("cuda"),
                                Precision.of(cfg.train, torch.device("cuda"), dims))
            states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
            assert len(states) == 1 + (2 if experts_sharded else 1) * cfg.model.num_layers  # root, layers, experts
            for s in states:
                assert s._mp_policy.param_dtype == torch.bfloat16 and s._mp_policy.reduce_dtype == torch.bfloat16
            managed = {id(fp.sharded_param) for s in states if s._fsdp_param_group
                       for fp in s._fsdp_param_group.fsdp_params}
            experts = [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]
            assert all((id(p) in managed) is experts_sharded for p in experts)
            assert Precision.of(cfg.train, torch.device("cuda"), dims).copy == ("none" if experts_sharded
                                                                                else "experts")


def test_reduce_dtype_without_fsdp_is_an_error():
    from pithtrain.distributed.parallel_dims import ParallelDims
    cfg = load_config(None, ["train.reduce_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="train.reduce_dtype: bfloat16: only FSDP reduces gradients"):
        ParallelDims.from_config(cfg, 1, 0)


# ---------------------------------------------------------------------------------------------
# parallel: auto on 8 gloo processes equals one process (the harness of tests/test_distributed.py)

# Each family's shipped recipe (`parallel: auto`) with layers and widths reduced; expert count and
# top-k stay real (Qwen3 128 top-8 with full activation checkpointing from its recipe, DeepSeek 64
# top-6 + 2 shared, GPT-OSS 32 top-4). Auto picks dp=8 for Qwen3 and DeepSeek, whose vocabularies
# shrink to the bytes' 264 (the pick is the same as at their real size, and a replicated 150K x 32
# embedding on every rank is most of the test's time); GPT-OSS keeps its real 201K vocabulary, for
# which auto picks fsdp=8 (dp=8 below ~130K).
SMALL = {
    "qwen3-30b-a3b": ["model.vocab_size=264", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
                      "model.num_kv_heads=2", "model.head_dim=8", "model.moe_intermediate_size=16"],
    "deepseek-v2-lite": ["model.vocab_size=264", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
                         "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8",
                         "model.v_head_dim=8", "model.intermediate_size=32", "model.moe_intermediate_size=16"],
    "gpt-oss-20b": ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2",
                    "model.head_dim=8", "model.intermediate_size=16"],
}
WORLD = 8


def trained_layout(cfg):
    """train(cfg) and the layout it ran in, from rank 0's start-up line (cfg keeps `auto`'s unset sizes)."""
    import contextlib
    import io

    from pithtrain.train import train
    with contextlib.redirect_stdout(io.StringIO()) as out:
        hist, model = train(cfg)
    sizes = re.search(r"parallel auto: pp=(\d+) dp=(\d+) fsdp=(\d+) cp=(\d+) ep=(\d+)", out.getvalue())
    return hist, model, [int(x) for x in sizes.groups()] if sizes else None


def small_cfg(recipe: str, run_dir: str, grad_accum: int = 1):
    return load_config(recipe, [*SMALL[recipe], "train.steps=3", "train.micro_batch_size=2", "train.seq_len=16",
                                f"train.grad_accum={grad_accum}", "train.global_batch_tokens=",
                                "train.activation_checkpoint=none", "train.warmup_steps=1", "train.device=cpu",
                                "data.max_bytes=20000", "checkpoint.final=false", "log.every=1",
                                f"log.run_dir={run_dir}"])


def _auto_worker(rank: int, world: int, port: int, tmp: str):
    from test_distributed import _init
    from torch.distributed.tensor import DTensor
    dist = _init(rank, world, port)
    results = {}
    for recipe in SMALL:
        cfg = small_cfg(recipe, f"{tmp}/r{rank}/{recipe}")
        hist, model, layout = trained_layout(cfg)
        params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                  for n, p in model.named_parameters()}
        if rank == 0:
            ref = torch.load(f"{tmp}/ref-{recipe}.pt")
            results[recipe] = {
                "layout": layout,
                "loss": [h["loss"] for h in hist], "ref_loss": [h["loss"] for h in ref["hist"]],
                "gnorm": [h["grad_norm"] for h in hist], "ref_gnorm": [h["grad_norm"] for h in ref["hist"]],
                "param_max_diff": max((params[n] - ref["params"][n]).abs().max().item() for n in params),
                "param_max_update": max((ref["params"][n] - ref["init"][n]).abs().max().item() for n in params)}
    if rank == 0:
        Path(tmp, "auto.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_auto_layout_on_8_processes_matches_one(tmp_path):
    """Every family's recipe with `parallel: auto` on 8 gloo processes trains 3 steps equal to one
    process running the same 8 micro-batches per step (tolerances and why: tests/test_distributed.py),
    in the layout auto_layout ranks fastest for 8 processes (no GPU: no memory plan), asked here
    in this process: every rank agrees with it."""
    from test_distributed import PARAM_ATOL, RTOL, free_port

    from pithtrain.models import build_model
    for recipe in SMALL:
        cfg = small_cfg(recipe, str(tmp_path / "ref" / recipe), grad_accum=WORLD)
        torch.manual_seed(cfg.train.seed)
        init = {n: p.detach().clone() for n, p in build_model(cfg.model, "cpu").named_parameters()}
        hist, model, layout = trained_layout(cfg)
        assert layout[2:] == [1, 1, 1]  # auto on one process: fsdp, cp, ep 1
        torch.save({"hist": hist, "init": init,
                    "params": {n: p.detach() for n, p in model.named_parameters()}},
                   tmp_path / f"ref-{recipe}.pt")
    spawn(_auto_worker, args=(WORLD, free_port(), str(tmp_path)), nprocs=WORLD)
    results = json.loads((tmp_path / "auto.json").read_text())
    assert list(results) == list(SMALL)
    picks = {}
    for recipe in SMALL:
        lay = planner.auto_layout(small_cfg(recipe, str(tmp_path / "pick")), WORLD, None)[0]
        picks[recipe] = [lay[k] for k in ("pp", "dp", "fsdp", "cp", "ep")]
    reports = {}
    for recipe, r in results.items():
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(r["loss"], r["ref_loss"]))
        gnorm_err = max(abs(a - b) / abs(b) for a, b in zip(r["gnorm"], r["ref_gnorm"]))
        reports[recipe] = (loss_err, gnorm_err, f"{recipe} {r['layout']}: loss rel {loss_err:.1e}, gnorm rel "
                           f"{gnorm_err:.1e}, params abs {r['param_max_diff']:.1e} "
                           f"(update {r['param_max_update']:.1e})")
    print("\n".join(x[2] for x in reports.values()))
    for recipe, r in results.items():
        loss_err, gnorm_err, report = reports[recipe]
        assert r["layout"] == picks[recipe], report
        assert len(r["loss"]) == 3 and loss_err < RTOL and gnorm_err < RTOL, report
        # The recipes' lr (3e-4) moves parameters less than test_distributed's 3e-3; still >10x the tolerance.
        assert r["param_max_diff"] < PARAM_ATOL and r["param_max_update"] > 10 * PARAM_ATOL, report


# ---------------------------------------------------------------------------------------------
# GPU: the plan against torch.cuda.max_memory_allocated of the real run


GPU_RUNS = ["qwen3-30b-a3b", "deepseek-v2-lite", "gpt-oss-20b", "default"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_planned_peak_within_10_percent_of_measured(tmp_path):
    """The three 4-layer bench configurations (real widths, micro-batch 2 x 4096, one per step, the
    recipe's own settings (compile) but the recomputation: Qwen3 cheap, DeepSeek selective,
    GPT-OSS none) and the default recipe, 3 steps of train.py on one GPU each. Prints planned vs
    measured; the lead runs it on the H200:
        python -m pytest -m gpu tests/test_plan.py -s -p no:cacheprovider"""
    import gc

    from pithtrain.train import train
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / planner.GIB
    bench = ["model.num_layers=4", "train.micro_batch_size=2", "train.seq_len=4096",  # the 4-layer bench line
             "train.global_batch_tokens=", "train.grad_accum=1"]
    policy = {"qwen3-30b-a3b": "cheap", "deepseek-v2-lite": "selective", "gpt-oss-20b": "none"}
    rows = []
    for name in GPU_RUNS:
        own = [] if name == "default" else [*bench, f"train.activation_checkpoint={policy[name]}"]
        cfg = load_config(None if name == "default" else name, [
            *own, "train.steps=3", "train.warmup_steps=1", "log.every=1", "checkpoint.final=false",
            f"log.run_dir={tmp_path / name}", "train.device=cuda"])
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        train(cfg, resume=False)
        measured = torch.cuda.max_memory_allocated() / planner.GIB
        planned = planner.plan(planner.resolve(cfg, 1)[0], 1, gpu_gib)  # the layout train resolved (auto: world 1)
        rows.append((name, planned["peak_gib"], measured, planned["ranks"][0]))
        print(f"plan-vs-measured: {name}: planned {rows[-1][1]:.2f} GiB, measured {measured:.2f} GiB", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, 3 steps of train.py each\n"
          "| run | planned GiB | measured GiB | planned / measured | params | grads | optimizer | "
          "activations | comm |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, p, m, r in rows:
        parts = " | ".join(f"{r[k] / planner.GIB:.2f}" for k in ("params", "grads", "optimizer", "activations", "comm"))
        print(f"| {name} | {p:.2f} | {m:.2f} | {p / m:.3f} | {parts} |")
    for name, p, m, _ in rows:
        assert abs(p - m) <= 0.10 * m, f"{name}: planned {p:.2f} GiB, measured {m:.2f} GiB"


@pytest.mark.parametrize("bad", [
    ["parallel.pp=2", "parallel.fsdp=2", "parallel.pp_schedule=dualpipev", "train.grad_accum=2"],
    ["parallel.pp=2", "parallel.cp=2", "train.compile=false"],
    ["parallel.pp=2", "parallel.fsdp=2", "parallel.ep=2", "parallel.pp_schedule=dualpipev", "train.grad_accum=4",
     "parallel.pp_overlap=true", "train.activation_checkpoint=full"],
    ["parallel.fsdp=4", "parallel.ep=3"],
    ["parallel.fsdp=3"],
])
def test_plan_and_train_reject_a_recipe_with_the_same_line(bad, monkeypatch, capsys):
    """One set of layout checks (ParallelDims.validate): `invoke plan` and train.py, before any
    process group or model exists, refuse the same recipe with the same one-line error."""
    from pithtrain import train
    layout = {"parallel.pp": "1", "parallel.dp": "1", "parallel.fsdp": "1", "parallel.cp": "1", "parallel.ep": "1"}
    sets = [f"{k}={v}" for k, v in layout.items() if not any(b.startswith(k + "=") for b in bad)] + bad
    assert planner.main(["--gpu", "h100", "--gpus", "4", *sum((["--set", s] for s in sets), [])]) == 2
    planned = capsys.readouterr().err.strip()
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert train.main([*sets, "train.device=cpu"]) == 2
    trained = capsys.readouterr().err.strip()
    assert planned.startswith("error: ") and "\n" not in planned and planned == trained


# ---------------------------------------------------------------------------------------------
# Activations: the plan's per-layer count against what autograd saves


# Tiny widths of each family, every width distinct enough to tell the terms apart (Qwen3 with a
# dense first layer; DeepSeek's d_qk = d_v, which CPU SDPA's flash kernel needs).
TINY = {
    "qwen3-30b-a3b": ["model.hidden_size=48", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16",
                      "model.moe_intermediate_size=24", "model.intermediate_size=40", "model.mlp_only_layers=[0]"],
    "deepseek-v2-lite": ["model.hidden_size=48", "model.num_heads=4", "model.kv_lora_rank=16",
                         "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=16",
                         "model.intermediate_size=40", "model.moe_intermediate_size=24"],
    "gpt-oss-20b": ["model.hidden_size=48", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16",
                    "model.intermediate_size=24", "model.sliding_window=8"],
    "default": [],  # heads x head_dim == hidden_size: o_proj's input is not the normalised input
}


def cuda_like(model):
    """Bind CPU stand-ins for the CUDA kernels that save what those kernels save: the attention
    kernel (SDPA's CPU flash kernel: q, k, v, output, log-sum-exp, as flash-attn-4 and FlexAttention;
    GPT-OSS's sinks and window are left out, which changes no shape), the fused SwiGLU (its input
    alone: kernels/swiglu.py) and the fused combine (the rows, weights and order: kernels/permute.py)
    in place of the references, which keep more (the activation's parts; index_add's source)."""
    import functools

    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from pithtrain.models.common import GroupedExperts, LocalDispatcher, swiglu

    def kept(fn, *args):  # saves its tensor arguments only
        return checkpoint(fn, *args, use_reentrant=False)

    def sdpa(q, k, v, *, scale, window=None, sinks_H=None, docs=None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    for mod in model.modules():
        if type(mod).__name__ == "Attention":
            mod.attention = sdpa
        if isinstance(mod, GroupedExperts):
            mod.swiglu = functools.partial(kept, swiglu)
        if isinstance(getattr(mod, "dispatcher", None), LocalDispatcher):
            combine = mod.dispatcher.combine
            mod.dispatcher.combine = lambda y, w, info, ref=combine: kept(
                lambda y, w, order: ref(y, w, (order, info[1], None)), y, w, info[0])


def saved_per_token(cfg, mode: str, B: int = 2, S: int = 32) -> dict:
    """{(layer, "attn" | "mlp"): bytes per token} that autograd keeps for backward, counted with
    torch's saved-tensor hooks (each storage once; parameters and the shared RoPE tables left out)
    inside each layer's attention phase and the rest of it; bf16 weights under bf16 autocast, with
    train.compile the compiled parts compiled as on CUDA (AOTAutograd's partitioner decides what a
    graph keeps)."""
    from pithtrain import compile as ac
    from pithtrain.models import build_model
    from pithtrain.models.common import decoder_layers

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = build_model(cfg.model, init=True).to(torch.bfloat16)
    cuda_like(model)
    ac.apply_activation_checkpoint(model, mode)
    if cfg.train.compile:
        ac.apply_compile(model, backend="aot_eager")
    where, got = [None], {}
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if where[0] is not None and t.untyped_storage().data_ptr() not in skip:
            got.setdefault(where[0], {})[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def within(fn, key, after=None):
        def call(*args, **kwargs):
            where[0] = key
            try:
                return fn(*args, **kwargs)
            finally:
                where[0] = after
        return call
    rotary = model.rotary.forward

    def rope(*args):
        out = rotary(*args)
        skip.update(t.untyped_storage().data_ptr() for t in out if isinstance(t, torch.Tensor))
        return out
    model.rotary.forward = rope
    for i, layer in enumerate(decoder_layers(model)):
        layer.forward = within(layer.forward, (i, "mlp"))
        layer.attend = within(layer.attend, (i, "attn"), (i, "mlp"))
    ids = torch.randint(0, cfg.model.vocab_size, (B, S))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids, labels_BS=ids)
    torch._dynamo.reset()
    return {k: sum(v.values()) / (B * S) for k, v in got.items()}, model


@pytest.mark.parametrize("recipe", list(TINY))
@pytest.mark.parametrize("mode,compiled", [("none", True), ("cheap", True), ("selective", True), ("full", True),
                                           ("none", False), ("selective", False)])
def test_planned_activations_are_what_autograd_saves(recipe, mode, compiled):
    """plan.layer_activations, per layer and part, against the bytes autograd keeps (saved_per_token)
    at tiny widths, within 3% (what the count leaves out: the router's and the balancing unit's few
    small tensors, a bf16 copy of the router's weight), compiled and eager (the default recipe runs
    eager on CUDA; checkpointed regions keep their tensors out of the hooks' sight, so cheap and
    full are counted compiled only: their policy, not the compiler, decides what they keep)."""
    from pithtrain.models.common import decoder_layers

    cfg = load_config(recipe, [*TINY[recipe], "model.num_layers=2", "model.num_experts=8", "model.top_k=3",
                               "model.vocab_size=300", f"train.activation_checkpoint={mode}",
                               f"train.compile={str(compiled).lower()}"])
    got, model = saved_per_token(cfg, mode)
    for i, layer in enumerate(decoder_layers(model)):
        want = planner.layer_activations(layer, i, cfg, 2, mode)
        for part, w in zip(("attn", "mlp"), want):
            g = got.get((i, part), 0)
            assert w == pytest.approx(g, rel=0.03, abs=1), (recipe, mode, i, part, g, w)


def test_expert_parallel_rows_are_the_busiest_ranks_and_the_combine_keeps_its_received_rows():
    """With ep > 1 a MoE layer's routed-expert rows are counted at the calibration routing's
    busiest-over-mean (the emulated GPT-OSS rank at fsdp=8 ep=8 measured 2.3% over the plan with
    it, docs/perf-notes.md) and the combine keeps the c A D rows it receives back; one process
    (ep = 1) is the balanced count."""
    from pithtrain.models import build_model
    cfg = load_config("gpt-oss-20b", ["parallel.auto=false", "parallel.fsdp=8", "parallel.ep=8",
                                      "train.activation_checkpoint=none", "train.global_batch_tokens=null"])
    model = build_model(cfg.model, torch.device("meta"))
    layer, m = model.layers[0], cfg.model
    b = planner.busiest(cfg.model.family, cfg.parallel.ep)
    assert b == perf.load_costs()["families"]["gpt_oss"]["balance"]["group_max_mean"]["8"] > 1
    ep8 = planner.layer_activations(layer, 0, cfg, 2, "none")[1]
    one = planner.layer_activations(layer, 0, dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, fsdp=1, ep=1)), 2, "none")[1]
    rows = 2 * m.hidden_size + 3 * layer.mlp.experts.hidden
    assert ep8 - one == round(2 * m.top_k * (rows * b + m.hidden_size)) - 2 * m.top_k * rows


def test_an_override_auto_would_replace_is_refused_in_one_line():
    """Under parallel: auto with train.global_batch_tokens the planner chooses micro_batch_size and
    grad_accum: a command-line value for either would be dropped, so it is refused, naming the way
    to keep it; with global_batch_tokens=null it is kept."""
    with pytest.raises(ConfigError, match=r"^command-line override 'train.grad_accum=4': parallel: auto "
                                          r"chooses .*add train.global_batch_tokens=null to keep yours$"):
        load_config("qwen3-30b-a3b", ["train.grad_accum=4"])
    assert load_config("qwen3-30b-a3b", ["train.grad_accum=4", "train.global_batch_tokens=null"]).train.grad_accum == 4
