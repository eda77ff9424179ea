"""Distributed training equals one process (issue 4), on gloo worlds of 2 and 4 CPU processes.

Each layout trains 3 optimizer steps of a tiny model on the same global batch as a single
process (the reference: the same micro-batch size, grad_accum multiplied by the number of
batch ranks, so each rank's micro-batch is one of the reference's micro-batches) and must give
the same loss and gradient norm at every step and the same parameters after the last step.
Layouts (issue notation -> recipe; ep borrows ranks from fsdp*cp, see parallel_dims.py):

    world 2  fsdp=2 -> fsdp=2          ep=2 -> fsdp=2 ep=2       cp=2 -> cp=2
             cp=2 x ep=2 -> cp=2 ep=2  (the two halves of each sequence route to each other's experts)
    world 4  fsdp=2 x ep=2 -> fsdp=4 ep=2 (experts split 2 ways by expert, 2 ways by width)
             dp=2 x ep=2 -> dp=2 fsdp=2 ep=2 (HSDP)     cp=2 x ep=2 -> fsdp=2 cp=2 ep=2

The load-balancing loss is on (coefficient 0.01): with dp/fsdp it is per micro-batch exactly
as in the reference; with cp its statistics are all-reduced over the cp ranks
(ContextParallelSum, each MoE block's `balance.stats_sum`), so it is the same function too.

Tolerance (float32). Nothing is approximated; what differs is the order of float additions:
FSDP sums gradients across ranks, expert parallel sums a token's expert outputs per rank and
then across ranks, context parallel runs attention as two masked chunk calls, and the global
gradient norm is summed in float64 from shards. These are ~1e-7 relative per operation
(observed: losses and grad norms within 4e-7 relative). Parameters after 3 AdamW steps (lr
3e-3; Adam's early update is ~lr * g / |g| per element, so an element with a tiny gradient turns
a 1e-7 gradient difference into a larger update difference) differ by up to ~1e-5 (observed
8e-6, context parallel). We allow 1e-5 relative on losses and grad norms and 5e-5 absolute on
parameters, under 1% of the 7.7e-3 the parameters move in 3 steps. A real bug (a missing
gradient sum, a wrong chunk, an expert on the wrong rank) moves the loss by > 1e-3 and
parameters by ~lr.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import weakref

import pytest
import torch
import variant
from ranks import spawn
from run_path import dispatched, ep_rank_step

from pithtrain.config import ConfigError, config_from_dict, load_config
from pithtrain.metrics import flops_per_token

FAMILIES = {
    "qwen3_moe": dict(family="qwen3_moe", vocab_size=264, hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=8, top_k=2,
                      aux_loss_coeff=0.01),
    "deepseek_v2": dict(family="deepseek_v2", vocab_size=264, hidden_size=32, num_layers=2,
                        num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                        v_head_dim=8, first_k_dense_replace=1, intermediate_size=32,
                        moe_intermediate_size=16, num_experts=8, n_shared_experts=1, top_k=2,
                        aux_loss_coeff=0.01),
    # sliding window 4 < the 8-token chunks of cp=2 at seq 16: windows cross chunk borders
    "gpt_oss": dict(family="gpt_oss", vocab_size=264, hidden_size=32, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, intermediate_size=16, num_experts=8, top_k=2,
                    sliding_window=4, aux_loss_coeff=0.01),
}
LAYOUTS = {
    2: {"fsdp=2": dict(fsdp=2), "ep=2": dict(fsdp=2, ep=2), "cp=2": dict(cp=2),
        "cp=2 x ep=2": dict(cp=2, ep=2)},
    4: {"fsdp=2 x ep=2": dict(fsdp=4, ep=2), "dp=2 x ep=2": dict(dp=2, fsdp=2, ep=2),
        "cp=2 x ep=2": dict(fsdp=2, cp=2, ep=2)},
}
# Qwen3 runs every layout, DeepSeek-V2 (MLA, shared experts) every 2-process layout and HSDP,
# GPT-OSS (sinks + sliding window) the context-parallel ones: its EP/FSDP path is the same code
# as the other families', and the 4-process world costs the most time on 2 cores.
RUNS = {2: [(f, n) for f in FAMILIES for n in LAYOUTS[2] if f != "gpt_oss" or n.startswith("cp")],
        4: [("qwen3_moe", n) for n in LAYOUTS[4]] + [("deepseek_v2", "dp=2 x ep=2")]}
# Activation checkpointing recomputes the experts' all-to-all and FSDP gathers in backward.
ACTIVATION_CHECKPOINT = {(2, "ep=2"): "full", (4, "dp=2 x ep=2"): "selective"}
RTOL, PARAM_ATOL = 1e-5, 5e-5


def make_cfg(family: str, parallel: dict, grad_accum: int, run_dir: str):
    return config_from_dict({
        "model": variant.model(FAMILIES[family]),  # validate.py --set: a variant's switch
        "train": dict(steps=3, micro_batch_size=2, seq_len=16, grad_accum=grad_accum, warmup_steps=1,
                      device="cpu"),
        "data": dict(max_bytes=20000),
        "parallel": parallel,
        "checkpoint": dict(final=False),
        "log": dict(every=1, run_dir=run_dir),
    })


def batch_ranks(parallel: dict) -> int:
    return parallel.get("dp", 1) * parallel.get("fsdp", 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Workers (one per rank; tests/ranks.py starts them)


def _init(rank: int, world: int, port: int):
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return dist


def _parity_worker(rank: int, world: int, port: int, tmp: str):
    from torch.distributed.tensor import DTensor

    from pithtrain.train import train
    dist = _init(rank, world, port)
    results = {}
    for family, name in RUNS[world]:
        parallel = LAYOUTS[world][name]
        cfg = make_cfg(family, parallel, 1, os.path.join(tmp, f"r{rank}", family, name))
        cfg.train.activation_checkpoint = ACTIVATION_CHECKPOINT.get((world, name), "none")
        hist, model = train(cfg)
        params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                  for n, p in model.named_parameters()}
        if rank == 0:
            ref = torch.load(os.path.join(tmp, f"ref-{family}-{batch_ranks(parallel)}.pt"))
            assert params.keys() == ref["params"].keys()
            results[f"{family} {name}"] = {
                "loss": [h["loss"] for h in hist], "ref_loss": [h["loss"] for h in ref["hist"]],
                "gnorm": [h["grad_norm"] for h in hist], "ref_gnorm": [h["grad_norm"] for h in ref["hist"]],
                "param_max_diff": max((params[n] - ref["params"][n]).abs().max().item() for n in params),
                "param_max_update": max((ref["params"][n] - ref["init"][n]).abs().max().item()
                                        for n in params)}
    if rank == 0:
        with open(os.path.join(tmp, f"results-{world}.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


def _reference(family: str, bs: int, tmp) -> None:
    """Single process, grad_accum = number of batch ranks: the same global batch and micro-batches."""
    from pithtrain.models import build_model
    from pithtrain.train import train
    path = tmp / f"ref-{family}-{bs}.pt"
    if path.exists():
        return
    cfg = make_cfg(family, {}, bs, str(tmp / "ref"))
    torch.manual_seed(cfg.train.seed)
    init = {n: p.detach().clone() for n, p in build_model(cfg.model, "cpu").named_parameters()}
    hist, model = train(cfg)
    torch.save({"hist": hist, "init": init,
                "params": {n: p.detach() for n, p in model.named_parameters()}}, path)


@pytest.mark.parametrize("world", [2, 4])
def test_layouts_match_single_process(world, tmp_path):
    for family, name in RUNS[world]:
        _reference(family, batch_ranks(LAYOUTS[world][name]), tmp_path)
    spawn(_parity_worker, args=(world, free_port(), str(tmp_path)), nprocs=world)
    results = json.loads((tmp_path / f"results-{world}.json").read_text())
    assert len(results) == len(RUNS[world])
    report = []
    for key, r in results.items():
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(r["loss"], r["ref_loss"]))
        gnorm_err = max(abs(a - b) / abs(b) for a, b in zip(r["gnorm"], r["ref_gnorm"]))
        report.append(f"{key}: loss rel {loss_err:.1e}, gnorm rel {gnorm_err:.1e}, "
                      f"params abs {r['param_max_diff']:.1e} (update {r['param_max_update']:.1e})")
        assert loss_err < RTOL and gnorm_err < RTOL, report[-1]
        assert r["param_max_diff"] < PARAM_ATOL, report[-1]
        assert r["param_max_update"] > 100 * PARAM_ATOL, report[-1]  # the parameters did move
    print("\n".join(report))


# ---------------------------------------------------------------------------------------------
# Dispatch deduplication


def _dedup_worker(rank: int, world: int, port: int, tmp: str):
    from pithtrain.models.common import GroupedExperts, LocalDispatcher
    dist = _init(rank, world, port)
    E, D, F, T, A = 8, 16, 12, 24, 4
    El = E // world
    torch.manual_seed(0)  # the same global tokens, routing and experts on every rank
    full = GroupedExperts(E, D, F)
    torch.nn.init.normal_(full.w13_EDF2, std=0.3)
    torch.nn.init.normal_(full.w2_EFD, std=0.3)
    x = torch.randn(world * T, D)
    # top-4 of 8 experts on 2 ranks: most tokens have two or more experts on the same rank
    idx = torch.stack([torch.randperm(E)[:A] for _ in range(world * T)])
    w = torch.rand(world * T, A)
    g = torch.randn(world * T, D)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (dispatched(LocalDispatcher(), xr, idx, wr, full) * g).sum().backward()
    mine = slice(rank * T, (rank + 1) * T)
    y, xl, wl, local, d = ep_rank_step(full, rank, world, x, idx, w, g)
    y_ref = dispatched(LocalDispatcher(), x, idx, w, full)[mine]
    torch.testing.assert_close(y, y_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xl.grad, xr.grad[mine], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wl.grad, wr.grad[mine], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(local.w13_EDF2.grad, full.w13_EDF2.grad[rank * El:(rank + 1) * El],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(local.w2_EFD.grad, full.w2_EFD.grad[rank * El:(rank + 1) * El],
                               rtol=1e-5, atol=1e-5)
    # one row per (token, slot) without deduplication: every slot, and those of experts on the other rank
    naive = [idx[mine].numel(), int((idx[mine] // El != rank).sum())]
    out = {"dedup": [d.rows_sent, d.rows_sent_remote], "naive": naive}
    if rank == 0:
        with open(os.path.join(tmp, "dedup.json"), "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def test_dispatch_deduplication_sends_fewer_rows_same_result(tmp_path):
    spawn(_dedup_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    out = json.loads((tmp_path / "dedup.json").read_text())
    (dedup_all, dedup_remote), (naive_all, naive_remote) = out["dedup"], out["naive"]
    assert naive_all == 24 * 4  # one row per (token, slot)
    assert dedup_all <= 24 * 2  # at most one row per (token, rank)
    assert dedup_remote < naive_remote, out


def _fp8_ep_worker(rank: int, world: int, port: int, tmp: str):
    """FP8 expert GEMMs (PyTorch reference operators on CPU) behind the all-to-all dispatcher."""
    from pithtrain.distributed.expert_parallel import ExpertParallelDispatcher
    from pithtrain.kernels.fp8_linear import FP8GroupedMM
    from pithtrain.models.common import GroupedExperts, LocalDispatcher
    dist = _init(rank, world, port)
    E, D, F, T, A = 8, 160, 136, 160, 2  # widths past one 128 block; 640 rows: several token tiles
    El = E // world
    torch.manual_seed(0)
    full = GroupedExperts(E, D, F)
    full.mm = FP8GroupedMM()
    torch.nn.init.normal_(full.w13_EDF2, std=0.1)
    torch.nn.init.normal_(full.w2_EFD, std=0.1)
    x, g = torch.randn(world * T, D), torch.randn(world * T, D)
    idx = torch.stack([torch.randperm(E)[:A] for _ in range(world * T)])
    w = torch.rand(world * T, A)
    xr = x.clone().requires_grad_()
    y_ref = dispatched(LocalDispatcher(), xr, idx, w, full)
    (y_ref * g).sum().backward()
    local = GroupedExperts(El, D, F)
    local.mm = FP8GroupedMM()
    with torch.no_grad():
        local.w13_EDF2.copy_(full.w13_EDF2[rank * El:(rank + 1) * El])
        local.w2_EFD.copy_(full.w2_EFD[rank * El:(rank + 1) * El])
    mine = slice(rank * T, (rank + 1) * T)
    xl = x[mine].clone().requires_grad_()
    y = dispatched(ExpertParallelDispatcher(dist.group.WORLD, rank, world, E), xl, idx[mine], w[mine], local)
    (y * g[mine]).sum().backward()
    # Forward and data grad quantise per row (1 x 128 along the width) and per 128 x 128 block of
    # one expert's weight: the same FP8 operands on any rank, so equal up to summation order.
    torch.testing.assert_close(y, y_ref[mine].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xl.grad, xr.grad[mine], rtol=1e-5, atol=1e-5)
    # The weight grad is the unquantised product of those same operands: equal up to summation order.
    out = {"quantised": full.mm.cache.quantised + local.mm.cache.quantised}  # FP8 ran: 2 weights each
    for name in ("w13_EDF2", "w2_EFD"):
        a, b = getattr(local, name).grad, getattr(full, name).grad[rank * El:(rank + 1) * El]
        out[name] = ((a - b).norm() / b.norm()).item()
    with open(os.path.join(tmp, f"fp8-ep-{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def test_fp8_expert_gemms_behind_the_expert_parallel_all_to_all(tmp_path):
    spawn(_fp8_ep_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        rel = json.loads((tmp_path / f"fp8-ep-{rank}.json").read_text())
        assert rel.pop("quantised") == 4
        assert all(v < 1e-5 for v in rel.values()), rel


# ---------------------------------------------------------------------------------------------
# Impossible layouts fail before any collective, with a clear message on every rank


@pytest.mark.quick
def test_impossible_layouts_rejected_by_arithmetic(tmp_path):
    import torch.distributed as dist

    from pithtrain.distributed.parallel_dims import ParallelDims
    cfg = make_cfg("qwen3_moe", dict(fsdp=2, ep=3), 1, str(tmp_path))
    with pytest.raises(ConfigError, match=r"parallel.ep: 3 does not divide model.num_experts \(8\)"):
        ParallelDims.from_config(cfg, world_size=2, rank=0)
    cfg = make_cfg("qwen3_moe", dict(fsdp=4), 1, str(tmp_path))
    with pytest.raises(ConfigError, match=r"pp\*dp\*fsdp\*cp = 1\*1\*4\*1 = 4 but 2 processes"):
        ParallelDims.from_config(cfg, world_size=2, rank=1)
    cfg = make_cfg("qwen3_moe", dict(cp=3), 1, str(tmp_path))
    with pytest.raises(ConfigError, match=r"train.seq_len: 16 must be divisible by 2\*cp = 6"):
        ParallelDims.from_config(cfg, world_size=3, rank=0)
    cfg = make_cfg("qwen3_moe", dict(fsdp=2, dp=3, ep=4), 1, str(tmp_path))
    with pytest.raises(ConfigError, match=r"ep: 4 must divide fsdp\*cp = 2, or be a multiple of it that "
                                          r"divides dp\*fsdp\*cp = 6"):
        ParallelDims.from_config(cfg, world_size=6, rank=0)
    dims = ParallelDims.from_config(make_cfg("qwen3_moe", dict(dp=2, ep=2), 1, str(tmp_path)), world_size=2,
                                    rank=1)  # ep over the dp replicas: experts 4..7 on rank 1
    assert (dims.edp, dims.efsdp, dims.ep_rank) == (1, 1, 1)
    cfg = make_cfg("qwen3_moe", dict(fsdp=3), 1, str(tmp_path))  # FSDP2 shards experts' dim 1 evenly only
    with pytest.raises(ConfigError, match=r"fsdp\*cp/ep = 3 ranks, which must divide model.hidden_size \(32\)"):
        ParallelDims.from_config(cfg, world_size=3, rank=0)
    cfg = make_cfg("gpt_oss", dict(fsdp=4, ep=2), 1, str(tmp_path))
    cfg.model.intermediate_size = 17
    with pytest.raises(ConfigError, match=r"fsdp\*cp/ep = 2 ranks, which must divide model.intermediate_size \(17\)"):
        ParallelDims.from_config(cfg, world_size=4, rank=0)
    cfg = make_cfg("qwen3_moe", dict(fsdp=2), 1, str(tmp_path))  # the family names its expert width
    cfg.model.moe_intermediate_size = 17
    with pytest.raises(ConfigError, match=r"2 ranks, which must divide model.moe_intermediate_size \(17\)"):
        ParallelDims.from_config(cfg, world_size=2, rank=0)
    cfg = make_cfg("qwen3_moe", dict(fsdp=2), 1, str(tmp_path))
    cfg.model.tie_word_embeddings = True
    with pytest.raises(ConfigError, match=r"model.tie_word_embeddings: a tied LM head is supported in one process"):
        ParallelDims.from_config(cfg, world_size=2, rank=0)
    assert not dist.is_initialized()  # the checks are arithmetic: no process group was needed


def test_torchrun_two_processes_trains_and_only_rank0_logs(tmp_path):
    """The launch `invoke train --nproc=2` performs: torchrun, one host, gloo on CPU."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "pithtrain.train",
           "parallel.fsdp=2", "parallel.ep=2", "train.device=cpu", "train.steps=2", "train.seq_len=16",
           "train.micro_batch_size=2", "model.hidden_size=32", "model.num_layers=1",
           "model.moe_intermediate_size=16", "data.max_bytes=20000", "log.every=1",
           "log.peak_tflops=1", "checkpoint.final=false", f"log.run_dir={tmp_path}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("step      2 | loss") == 1, p.stdout
    assert "world 2 (fsdp=2 x ep=2)" in p.stdout
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2
    # tokens/s counts both ranks; MFU is per GPU: against world_size x the per-GPU peak
    cfg = load_config(None, cmd[cmd.index("pithtrain.train") + 1:])
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    for r in recs:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / (1e12 * 2), rel=1e-9)


@pytest.mark.parametrize("init_from", [False, True])
def test_torchrun_ep_not_dividing_the_experts_fails_on_every_rank_before_any_collective(tmp_path, init_from):
    """Each rank, started with torchrun's environment, prints the error and exits 2 before
    init_process_group. The ranks are plain processes here: torchrun itself stops the other
    workers as soon as one exits, which would make "every rank printed it" a race. With
    train.init_from the layout is checked against the checkpoint's model (3 experts), not the
    recipe's (8), which ep=2 would divide."""
    if init_from:
        import transformers
        hub = transformers.Qwen3MoeConfig(vocab_size=264, hidden_size=32, intermediate_size=48,
                                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=8, moe_intermediate_size=16, num_experts=3,
                                          num_experts_per_tok=2, max_position_embeddings=4096)
        transformers.Qwen3MoeForCausalLM(hub).save_pretrained(tmp_path / "hub")
        extra = ["parallel.ep=2", f"train.init_from={tmp_path / 'hub'}"]
        msg = "parallel.ep: 2 does not divide model.num_experts (3)"
    else:
        extra, msg = ["parallel.ep=3"], "parallel.ep: 3 does not divide model.num_experts (8)"
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        cmd = [sys.executable, "-m", "pithtrain.train", "parallel.fsdp=2", *extra,
               "train.device=cpu", f"log.run_dir={tmp_path / 'run'}"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    for p in procs:  # a rank that reached a collective would wait for its peer and time out here
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2, out + err
        assert msg in err, out + err


# ---------------------------------------------------------------------------------------------
# GPU: the torchrun path on one GPU (world size 1: no process group, the single-device model)


@pytest.mark.gpu
def test_torchrun_one_gpu_world_size_1(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
           "--master-port", str(free_port()), "-m", "pithtrain.train", "train.device=cuda",
           "train.steps=5", "train.seq_len=64", "train.micro_batch_size=4", "log.every=1",
           "checkpoint.final=false", f"log.run_dir={tmp_path}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "device cuda:0" in p.stdout and p.stdout.rstrip().count("| world 1") == 1
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 5 and all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in recs)


@pytest.mark.quick
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_materialize_holds_one_block_at_a_time_and_matches_init_weights(family):
    """materialize (what every rank of a multi-process run calls) allocates one block of the whole
    model at a time on the host, and gives exactly the weights one process's init_weights gives
    under the same seed -- GPT-OSS included, whose init_block adds sinks and router biases."""
    from pithtrain.distributed.parallelize import materialize
    from pithtrain.models import FAMILIES, build_model
    from pithtrain.models.init import model_blocks

    width = {"intermediate_size": 32, "sliding_window": 4} if family == "gpt_oss" else {"moe_intermediate_size": 32}
    cfg = FAMILIES[family].config(**variant.model(dict(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4,
                                                       num_kv_heads=2, head_dim=8, num_experts=4, top_k=2, **width),
                                                  family))
    meta, model = build_model(cfg, init=False), build_model(cfg, init=False)
    init_block, seen, previous = meta.init_block, [], []

    def spy(block):
        gc.collect()
        freed = all(r() is None for r in previous)  # the last block's CPU tensors are gone
        live = sum(p.numel() for p in meta.parameters() if not p.is_meta)
        seen.append((live, sum(p.numel() for p in block.parameters()), freed))
        init_block(block)
        previous[:] = [weakref.ref(p) for p in block.parameters()]

    meta.init_block = spy
    materialize(model, meta, torch.device("cpu"), seed=5)
    assert len(seen) == len(list(model_blocks(model))) > 4
    assert all(live == held and freed for live, held, freed in seen), seen  # only the block in hand
    torch.manual_seed(5)
    ref = build_model(cfg, "cpu")
    got = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        assert torch.equal(got[name], p), name
    assert any(p.std() > 0 for n, p in ref.named_parameters() if "sinks" in n or "router.bias" in n) \
        or family != "gpt_oss"
