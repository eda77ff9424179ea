"""The performance model (pithtrain/perf.py) on hand-built cost tables where the answer is known,
`parallel: auto` ranking by it, and scripts/calibrate.py's measurement logic on CPU."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from pithtrain import perf
from pithtrain import plan as planner
from pithtrain.config import load_config

REPO = Path(__file__).resolve().parent.parent
TINY = ["model.num_layers=4", "model.hidden_size=256", "model.num_heads=4", "model.num_kv_heads=2",
        "model.head_dim=64", "model.moe_intermediate_size=256", "model.num_experts=8", "model.top_k=2",
        "model.vocab_size=1024", "train.seq_len=256", "train.micro_batch_size=2", "train.compile=false",
        "train.activation_checkpoint=none", "train.global_batch_tokens="]
ONE = {"pp": 1, "dp": 1, "fsdp": 1, "cp": 1, "ep": 1}


def calibrate_module():
    spec = importlib.util.spec_from_file_location("calibrate", REPO / "scripts" / "calibrate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def toy_costs(cfg, layer=(1e-3, 2e-3), experts_share=0.5, curve=None, imbalance=None, tail=1e-9):
    """A cost file for cfg's model itself (FLOP ratios 1): every MoE layer F, BW seconds per
    micro-batch on every path, later micro-batches as the first; the experts phase `experts_share`
    of a layer's forward, its ep curve {ep: factor on the ep=1 time} and group imbalance."""
    m = cfg.model
    curve = curve or {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
    imbalance = imbalance or {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
    phases = {"attn": 0.5 * (1 - experts_share), "route": 0.1 * (1 - experts_share),
              "dispatch": 0.1 * (1 - experts_share),
              "experts": experts_share, "combine": 0.1 * (1 - experts_share), "residual": 0.2 * (1 - experts_share)}
    lay = {"first": {"F": layer[0], "BW": layer[1]}, "later": {"F": layer[0], "BW": layer[1]}, "phases_F": phases}
    path = {"embed": {"F": 1e-4, "BW": 1e-4}, "head": {"F": 5e-4, "BW": 5e-4}, "tail_per_param": tail,
            "layers": {"moe": lay}}
    fam = {"tokens": cfg.train.micro_batch_size * cfg.train.seq_len, "head_flops": 2 * m.vocab_size * m.hidden_size,
           "layer_flops": {"moe": perf.layer_flops(m, 0, cfg.train.seq_len)[0]},
           "paths": {"train": path, "fsdp": path, "fsdp_sharded": path, "bench": path},
           "experts": {str(e): {"F": 1e-3 * f, "BW": 2e-3 * f} for e, f in curve.items()},
           "balance": {"group_max_mean": {str(e): v for e, v in imbalance.items()},
                       "remote_rows_per_token": {str(e): perf.remote_rows_per_token(m.num_experts, m.top_k, e)
                                                 for e in curve}}}
    fam["experts_fp8"] = fam["experts"]
    return {"gpu": "h200", "families": {m.family: fam}}


@pytest.mark.quick
def test_one_gpu_step_is_the_sum_of_its_parts():
    cfg = load_config("qwen3-30b-a3b", TINY + ["parallel.auto=false", "train.grad_accum=3"])
    costs = toy_costs(cfg)
    r = perf.predict(cfg, ONE, "h200", costs)
    per_mb = 4 * (1e-3 + 2e-3) + 2e-4 + 1e-3
    assert r["path"] == "train" and r["parts_s"]["compute"] == pytest.approx(3 * per_mb)
    assert r["parts_s"]["optimizer"] == pytest.approx(1e-9 * perf.local_params(cfg, ONE))
    assert r["step_s"] == pytest.approx(3 * per_mb + r["parts_s"]["optimizer"])
    assert r["tokens_per_s_per_gpu"] == pytest.approx(3 * 2 * 256 / r["step_s"])
    # full recompute adds each layer's forward to its backward
    full = load_config("qwen3-30b-a3b", TINY + ["parallel.auto=false", "train.grad_accum=3",
                                                "train.activation_checkpoint=full"])
    assert perf.predict(full, ONE, "h200", costs)["parts_s"]["compute"] == pytest.approx(3 * (per_mb + 4e-3))
    # selective adds the experts phase (half the forward here); cheap the attention phase's pointwise
    # work (its GEMMs and kernel take ~0.4 us of its 0.25 ms at these widths) and the SwiGLU pass
    compute = {mode: perf.predict(load_config("qwen3-30b-a3b", TINY + [
        "parallel.auto=false", "train.grad_accum=3", f"train.activation_checkpoint={mode}"]), ONE, "h200",
        costs)["parts_s"]["compute"] for mode in ("selective", "cheap")}
    assert compute["selective"] == pytest.approx(3 * (per_mb + 4 * 0.5e-3))
    assert compute["cheap"] == pytest.approx(3 * (per_mb + 4 * 0.25e-3), abs=3 * 4 * 1e-6)
    # on an H100 the part of a phase its FLOPs do not explain scales with memory bandwidth (4.8 / 3.35)
    slower = perf.predict(cfg, ONE, "h100", costs)["step_s"]
    assert r["step_s"] < slower < r["step_s"] * 4.8 / 3.35 + 1e-12


def test_the_experts_curve_and_imbalance_rank_the_layouts():
    """8 GPUs, the experts half of every layer: when more experts per rank make them faster (the
    ep curve falls), ep=8 is the fastest layout; when the ep=8 group is three times imbalanced,
    ep=4 is."""
    cfg = load_config("qwen3-30b-a3b", TINY)
    assert cfg.parallel.auto
    steep = {1: 1.0, 2: 0.5, 4: 0.25, 8: 0.125}
    fast = planner.ranked(cfg, 8, "h200", toy_costs(cfg, curve=steep))
    speeds = [c["prediction"]["tokens_per_s_per_gpu"] for c in fast]
    assert speeds == sorted(speeds, reverse=True) and len(fast) >= 8
    assert fast[0]["ep"] == 8 and fast[-1]["ep"] == 1
    skewed = planner.ranked(cfg, 8, "h200", toy_costs(cfg, curve=steep, imbalance={1: 1, 2: 1, 4: 1, 8: 3.0}))
    assert skewed[0]["ep"] == 4


def test_auto_takes_the_fastest_that_fits(monkeypatch):
    """Plans are made in order of predicted speed until one fits: a (faked) plan that fits only
    with ep <= 2 makes auto take the fastest such layout, having planned only the faster ones."""
    cfg = load_config("qwen3-30b-a3b", TINY)
    costs = toy_costs(cfg, curve={1: 1.0, 2: 0.5, 4: 0.25, 8: 0.125})
    monkeypatch.setattr(perf, "load_costs", lambda path=None: costs)
    planned = []

    def fake_plan(c, world, gpu_gib, gpu="", models=None):
        planned.append(c.parallel.ep)
        lay = {k: getattr(c.parallel, k) for k in ("pp", "dp", "fsdp", "cp", "ep")}
        peak = 10.0 * c.parallel.ep
        return {"layout": lay, "peak_gib": peak, "fits": peak <= 20.0, "usable_gib": 20.0, "gpu_gib": 22.0}

    monkeypatch.setattr(planner, "plan", fake_plan)
    lay, result = planner.auto_layout(cfg, 8, 22.0, "h200")
    ranking = [c for c in result["candidates"]]
    first_fit = next(c for c in ranking if c["ep"] <= 2)
    assert result["fits"] and lay["ep"] == first_fit["ep"] == result["layout"]["ep"] <= 2
    assert planned == [c["ep"] for c in ranking[:ranking.index(first_fit) + 1]]
    assert result["prediction"] is first_fit["prediction"]


def test_communication_over_the_network_and_the_overlap():
    """The all-to-all of ep=16 spans two nodes (the network, 46 of 50 GB/s) and costs more than
    ep=8's on NVLink; DualPipeV's overlapped pairs hide it (pp=2 x fsdp=4 x ep=4, 8 micro-batches)."""
    cfg = load_config("qwen3-30b-a3b", TINY + ["model.num_experts=16", "parallel.auto=false"])
    costs = toy_costs(cfg)
    costs["families"]["qwen3_moe"]["balance"]["remote_rows_per_token"]["16"] = perf.remote_rows_per_token(16, 2, 16)
    fam = costs["families"]["qwen3_moe"]
    nvlink = perf.comm_costs(cfg, {"pp": 1, "dp": 1, "fsdp": 16, "cp": 1, "ep": 8}, "h100", fam, 512)
    ib = perf.comm_costs(cfg, {"pp": 1, "dp": 1, "fsdp": 16, "cp": 1, "ep": 16}, "h100", fam, 512)
    assert ib[0]["a2a"] > 2 * nvlink[0]["a2a"] > 0
    pipe = load_config("qwen3-30b-a3b", TINY + ["parallel.auto=false", "train.grad_accum=8"])
    lay = {"pp": 2, "dp": 1, "fsdp": 4, "cp": 1, "ep": 4, "pp_schedule": "dualpipev"}
    on = perf.predict(pipe, {**lay, "pp_overlap": True}, "h100", costs)
    off = perf.predict(pipe, {**lay, "pp_overlap": False}, "h100", costs)
    assert on["step_s"] < off["step_s"] and on["parts_s"]["bubble"] > 0


def test_remote_rows_per_token_matches_enumeration():
    from itertools import combinations
    for E, k, ep in ((8, 2, 2), (8, 3, 4), (12, 2, 3)):
        sets = list(combinations(range(E), k))
        mean = sum(len({e // (E // ep) for e in s} - {0}) for s in sets) / len(sets)  # ranks other than 0
        assert perf.remote_rows_per_token(E, k, ep) == pytest.approx(mean)
    assert perf.remote_rows_per_token(64, 6, 1) == 0


def test_calibration_marks_become_per_layer_costs():
    """scripts/calibrate.py's parse of one instrumented step's marks (2 layers, 2 micro-batches),
    on made-up times: every interval lands where its mark says."""
    cal = calibrate_module()
    pts, t = [], 0.0

    def at(key, dt):
        nonlocal t
        t += dt
        pts.append((key, t))
    for mb in range(2):
        at(("F", "start"), 1.0 if mb else 0.0)  # mb 1 starts 1.0 after mb 0's layer-0 backward
        for i in range(2):
            for name, dt in (("attn", 0.5 if i == 0 else 0.0), ("experts", 2.0)):
                at(("F", i, name), dt)
        at(("F", "head"), 3.0)
        at(("F", "end"), 4.0)
        at(("B", "head"), 5.0)
        at(("B", 1), 6.0)
        at(("B", 0), 7.0)
    at(("end",), 8.0)
    mbs, tail = cal.costs_of_step(pts, 2)
    assert len(mbs) == 2 and tail == 8.0
    assert mbs[0]["embed"]["F"] == 0.5 and mbs[0]["embed"]["BW"] == 1.0
    assert mbs[0]["layers"][0]["phases"] == {"attn": 2.0, "experts": 0.0} and mbs[0]["layers"][0]["F"] == 2.0
    assert mbs[0]["layers"][1]["F"] == 5.0 and mbs[0]["head"] == {"F": 4.0, "BW": 5.0}
    assert mbs[1]["layers"][1]["BW"] == 6.0 and mbs[1]["layers"][0]["BW"] == 7.0


def test_calibration_runs_on_cpu_and_feeds_the_model(tmp_path):
    """The GPU measurement's dry run: tiny widths on CPU, one family, one check; the cost file it
    writes is complete and perf.predict reads it (CPU timings say nothing about a GPU: only the
    structure and positivity are asserted)."""
    cal, out = calibrate_module(), tmp_path / "costs.json"
    assert cal.main(["--cpu", "--models", "deepseek-v2-lite", "--out", str(out), "--warmup", "0", "--steps", "1",
                     "--paths", "train,fsdp", "--checks", "train:2", "--accums", "1,2"]) == 0
    data = json.loads(out.read_text())
    fam = data["families"]["deepseek_v2"]
    assert set(fam["paths"]) == {"train", "fsdp"} and set(fam["experts"]) == {"1", "2", "4", "8"}
    for path in fam["paths"].values():
        assert set(path["layers"]) == {"dense", "moe"} and path["tail_per_param"] > 0
        assert math.isclose(sum(path["layers"]["moe"]["phases_F"].values()), 1.0)
        assert all(v > 0 for w in ("first", "later") for v in path["layers"]["moe"][w].values())
    checks = data["checks"]
    assert [(c["path"], c["layers"], c["mb"]) for c in checks] == [("train", 2, 1), ("train", 2, 2)]
    assert all(c["measured_ms"] > 0 and c["predicted_ms"] > 0 for c in checks)


@pytest.mark.quick
def test_one_gpu_table_and_one_name_parser(monkeypatch):
    """pithtrain/gpus.py: the one table (the plan's memory, MFU's peak, the model's links, the
    recipe overrides of `--gpu`) and the one parser of a GPU's name, whole words only."""
    import torch

    from pithtrain.gpus import GPUS, gpu_key
    from pithtrain.metrics import peak_tflops
    assert [gpu_key(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "h100", "NVIDIA B200", "b300")] == [
        "h100", "h200", "h100", "b200", "b300"]
    assert gpu_key("NVIDIA GH200 480GB") is None and gpu_key("Tesla T4") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert peak_tflops(torch.device("cuda")) == GPUS["h200"].peak_tflops == 989.0
    assert peak_tflops(torch.device("cpu")) is None and peak_tflops(torch.device("cpu"), 5.0) == 5.0
    assert perf.link("h100", 8)[0] == GPUS["h100"].nvlink_gbs * 1e9 * perf.LINK_EFFICIENCY["nvlink"]
    assert "train.fp8=true" in GPUS["b200"].overrides and "train.fp8=true" not in GPUS["h100"].overrides
