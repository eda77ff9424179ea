"""One rank of an N-GPU layout on one device (pithtrain/emulate.py): the stand-in collectives
against their definitions; an emulated rank 0 of fsdp=4 x ep=2 against rank 0 of the same layout
on 4 gloo processes (the same collectives in the same order, FSDP's of the same shapes; a finite,
falling loss); the command line's table and its refusal of a pipeline; on a GPU, the memory cap."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from ranks import spawn

from pithtrain import emulate

# A seconds-long fsdp=4 x ep=2 run of the tiny default (world 4: experts split 2 ways by expert and 2 by width)
TINY = ["train.micro_batch_size=2", "train.seq_len=32", "train.warmup_steps=1", "model.hidden_size=32",
        "model.num_heads=4", "model.head_dim=8", "model.moe_intermediate_size=32", "model.num_layers=2",
        "data.max_bytes=100000", "parallel.fsdp=4", "parallel.ep=2"]
STEPS = 3
# torch.distributed's collectives as pithtrain, FSDP2 and DCP call them (torch 2.11 and 2.13 names)
COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
               "all_reduce", "all_to_all_single", "all_gather", "all_gather_object", "broadcast",
               "broadcast_object_list", "barrier")
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # 2.12+, 2.11
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@contextlib.contextmanager
def recording(calls: list):
    """Each collective called through torch.distributed, as (name, first tensor's shape, group size)."""
    saved = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}

    def wrap(name, f):
        def call(*args, **kwargs):
            t = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            calls.append([name, list(t.shape) if t is not None else None, dist.get_world_size(kwargs.get("group"))])
            return f(*args, **kwargs)
        return call

    for n, f in saved.items():
        setattr(dist, n, wrap(n, f))
    try:
        yield calls
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


# ---------------------------------------------------------------------------------------------
# The stand-ins against their definitions


@pytest.mark.quick
def test_standin_collectives_act_as_if_every_rank_were_this_one():
    R, me = 4, 1
    with emulate.standin_world(R, rank=me):
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("1", "4")
        x = torch.randn(5000)  # longer than the sign pattern's period: its tail is signed too
        out = torch.empty(R * 5000)
        ALL_GATHER(out, x)
        slots = out.view(R, -1)
        assert torch.equal(slots[me], x)  # its own slot as is, the others: the same magnitudes ...
        assert all(torch.equal(s.abs(), x.abs()) for s in slots)
        for i in range(R):  # ... with signs that differ from slot to slot
            for j in range(i):
                assert (slots[i] != slots[j]).float().mean() > 0.3
        objs = [None] * R
        dist.all_gather_object(objs, {"rank": me})  # list gathers copy (objects are unpickled)
        assert objs == [{"rank": me}] * R
        flat = torch.randn(R * 6)
        premul = dist._make_nccl_premul_sum(0.5)  # FSDP's op (its factor is 1 here: parallelize.py)
        premul_factor = R * getattr(premul, "factor", 1.0)  # torch 2.11 keeps the factor out of Python's reach
        for op, factor in ((dist.ReduceOp.SUM, R), (dist.ReduceOp.AVG, 1), (premul, premul_factor)):
            got = torch.empty(6)
            REDUCE_SCATTER(got, flat, op=op)
            assert torch.allclose(got, flat.view(R, 6)[me] * factor)
        for op, factor in ((dist.ReduceOp.SUM, R), (dist.ReduceOp.MAX, 1), (dist.ReduceOp.MIN, 1),
                           (dist.ReduceOp.AVG, 1)):
            t = torch.tensor([1.5, -2.0])
            dist.all_reduce(t, op=op)
            assert torch.equal(t, torch.tensor([1.5, -2.0]) * factor)
        # all-to-all: every slot gets what this rank sends itself (rows 1-2 of splits 1, 2, 3, 4) ...
        rows = torch.arange(10.0)[:, None].repeat(1, 3)
        got = torch.empty(8, 3)
        dist.all_to_all_single(got, rows, [2, 2, 2, 2], [1, 2, 3, 4])
        assert torch.equal(got, rows[1:3].repeat(4, 1))
        back = torch.empty(10, 3)  # ... repeated or cut where the sizes differ (the reverse exchange)
        dist.all_to_all_single(back, got, [1, 2, 3, 4], [2, 2, 2, 2])
        assert torch.equal(back, torch.cat([rows[1:2], rows[1:3], rows[[1, 2, 1]], rows[[1, 2, 1, 2]]]))
        none = torch.empty(4, 3)
        dist.all_to_all_single(none, torch.empty(4, 3), [1, 1, 1, 1], [2, 0, 2, 0])  # sends itself nothing
        assert torch.equal(none, torch.zeros(4, 3))
        dist.barrier()
        b = torch.tensor([7.0])
        dist.broadcast(b, src=0)
        assert b.item() == 7.0
        pg = dist.new_group(backend="gloo")  # the checkpointer's: a stand-in, not a wait for 4 processes
        assert isinstance(pg, emulate.StandIn) and pg.size() == R
    assert not dist.is_initialized() and dist.new_group.__module__ == "torch.distributed.distributed_c10d"
    assert "RANK" not in os.environ or os.environ["RANK"] != "1"


# ---------------------------------------------------------------------------------------------
# Emulated rank 0 against rank 0 of a real run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank: int, world: int, port: int, tmp: str):
    from pithtrain.train import train
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    cfg, _ = emulate.prepare(None, world, "h100", STEPS, TINY, gpu_overrides=False, run_dir=f"{tmp}/rank{rank}")
    with recording([]) as calls:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            history, _ = train(cfg, resume=False)
        finally:
            dist.destroy_process_group()
    if rank == 0:
        with open(f"{tmp}/real.json", "w") as f:
            json.dump({"calls": calls, "losses": [h["loss"] for h in history]}, f)


def test_emulated_rank_runs_rank_0s_collectives_and_trains(tmp_path, capsys):
    spawn(_gloo_rank, args=(4, _free_port(), str(tmp_path)), nprocs=4)
    real = json.loads((tmp_path / "real.json").read_text())
    with recording([]) as calls:
        code = emulate.main(["--gpus", "4", "--steps", str(STEPS), "--warmup", "1", *(f"--set={s}" for s in TINY)])
    out = capsys.readouterr().out
    assert code == 0, out
    # the same collectives in the same order over groups of the same sizes; FSDP's gathers and
    # reduce-scatters (and every other reduction) of the same shapes; the all-to-all's rows follow the routing
    assert [(n, g) for n, _, g in calls] == [(n, g) for n, _, g in real["calls"]]
    def shaped(cs):
        return [c for c in cs if c[0] != "all_to_all_single"]
    assert shaped(calls) == shaped(real["calls"])
    assert sum(n.startswith(("all_gather_single", "all_gather_into")) for n, _, _ in calls) > 0
    assert sum(n.startswith("reduce_scatter") for n, _, _ in calls) > 0
    assert sum(n == "all_to_all_single" for n, _, _ in calls) > 0
    # the table: the measured step and memory beside the model and the plan; the loss finite and falling
    table = out[out.index("emulated: rank 0 of pp=1 dp=1 fsdp=4 cp=1 ep=2 on 4 x h100, measured on cpu"):]
    assert "step (s), median of steps 2-3" in table and "peak memory (GiB), rank 0" in table
    assert "the model's step on 4 x h100" in table
    losses = [float(x) for x in table.split("| loss:")[1].split()]
    assert len(losses) == STEPS and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert losses[0] == pytest.approx(real["losses"][0], rel=0.02)  # the same model, other ranks' batches


def test_cli_refuses_a_pipeline_in_one_line(tmp_path):
    cmd = [sys.executable, "-m", "pithtrain.emulate", "--gpus", "4", *(f"--set={s}" for s in TINY),
           "--set=parallel.pp=2", "--set=parallel.fsdp=2", "--set=train.grad_accum=2"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("error: ")
    assert "parallel.pp=2: one emulated rank cannot play another pipeline stage" in p.stderr
    assert "emulated:" not in p.stdout


# ---------------------------------------------------------------------------------------------
# GPU: the memory cap


@pytest.mark.gpu
def test_emulated_rank_on_a_gpu_under_the_target_memory_cap(monkeypatch):
    from pithtrain import train as train_module
    cap = emulate.GPUS["h100"].memory_gib * 2 ** 30
    real, capped = train_module.train, []

    def train(cfg, **kwargs):  # inside the emulation: more than the target's memory is refused
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(cap) + 2 ** 30, dtype=torch.uint8, device="cuda")
        capped.append(True)
        return real(cfg, **kwargs)

    monkeypatch.setattr(train_module, "train", train)
    r = emulate.emulate(None, 4, "h100", STEPS, TINY, warmup=1)
    assert capped and r["device"].startswith("cuda")
    assert cap - 2 * 2 ** 30 < r["cap_gib"] * 2 ** 30 < cap  # less the CUDA context, which an H100 holds too
    assert 0 < r["peak_bytes"] < r["cap_gib"] * 2 ** 30 and len(r["step_s"]) == STEPS
    assert r["prediction_here"] is not None and r["prediction_target"] is not None  # the H200 has costs
    assert all(map(torch.isfinite, torch.tensor(r["losses"])))
    assert f"memory capped at {r['cap_gib']:.1f} GiB" in emulate.table(r)
    torch.cuda.empty_cache()  # and lifted afterwards
    assert torch.empty(int(cap) + 2 ** 30, dtype=torch.uint8, device="cuda").numel() > cap
