"""Checkpoints at scale (issue 20): per-rank hashing at commit and resume on 4 gloo ranks."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import variant
from ranks import spawn

TINY = ["train.micro_batch_size=4", "train.seq_len=64", "train.warmup_steps=5", "model.hidden_size=64",
        "model.num_heads=4", "model.head_dim=16", "model.moe_intermediate_size=64", "model.num_layers=2",
        "data.max_bytes=300000"]  # tests/test_checkpoint.py's tiny run
LAYOUT = ["parallel.fsdp=4", "parallel.ep=2", "train.device=cpu", "log.every=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hash_worker(rank: int, world: int, port: int, tmp: str):
    """Train 5 steps with a checkpoint at each (every rank records the files it hashed), then rank
    0 flips one byte in a different rank's shard of steps 5, 4, 3 and 2, and all resume."""
    import time

    import torch.distributed as dist

    import pithtrain.checkpoint.dcp as dcp_mod
    from pithtrain.config import load_config
    from pithtrain.train import train

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    hashed, seconds, real = [], [0.0], dcp_mod._sha256

    def spy(path, sync=False):
        t0 = time.perf_counter()
        out = real(path, sync)
        seconds[0] += time.perf_counter() - t0
        hashed.append(f"{path.parent.name}/{path.name}")
        return out

    dcp_mod._sha256 = spy
    run = f"{tmp}/run"
    cfg = load_config(None, TINY + variant.overrides(TINY + LAYOUT) + LAYOUT + ["train.steps=5", "checkpoint.every=1",
                                                                                "checkpoint.keep_last=5",
                                             f"log.run_dir={run}"])
    train(cfg, resume=False)
    saved = {"hashed": list(hashed), "seconds": seconds[0]}
    hashed.clear()
    dist.barrier()
    if rank == 0:
        for step, victim in ((5, 0), (4, 1), (3, 2), (2, 3)):
            p = Path(run, "checkpoints", f"step_{step}", f"__{victim}_0.distcp")
            data = bytearray(p.read_bytes())
            data[len(data) // 2] ^= 0x01
            p.write_bytes(bytes(data))
    dist.barrier()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train(load_config(None, TINY + variant.overrides(TINY + LAYOUT) + LAYOUT
                          + ["train.steps=5", f"log.run_dir={run}"]), resume=True)
    said = out.getvalue()
    Path(tmp, f"hash.{rank}.json").write_text(json.dumps({"save": saved, "resume": hashed, "said": said}))
    dist.destroy_process_group()


def test_every_rank_hashes_its_own_files_and_a_flipped_byte_is_named(tmp_path):
    spawn(_hash_worker, args=(4, free_port(), str(tmp_path)), nprocs=4)
    got = [json.loads((tmp_path / f"hash.{r}.json").read_text()) for r in range(4)]
    ck = tmp_path / "run" / "checkpoints"
    # Commit: each rank hashed exactly its own files; together, every file of every manifest once.
    # (steps 2-5 were damaged and set aside at resume; step_1 is the one left whole)
    for r, g in enumerate(got):
        for entry in g["save"]["hashed"]:
            step, name = entry.split("/")
            assert name.startswith(f"__{r}_") or (r == 0 and not name.startswith("__")), (r, entry)
        print(f"rank {r}: hashed {len(g['save']['hashed'])} files in {g['save']['seconds']:.3f} s")
    manifest = json.loads((ck / "step_1" / "manifest.json").read_text())["files"]
    at_commit = sorted(e.split("/")[1] for g in got for e in g["save"]["hashed"] if e.startswith(".tmp-step_1/"))
    assert at_commit == sorted(manifest)
    assert {f"__{r}_0.distcp" for r in range(4)} <= set(manifest)
    # Resume: each damaged file is named, by whichever rank hashed it; step_1 verified by all
    said = got[0]["said"]
    for step, victim in ((5, 0), (4, 1), (3, 2), (2, 3)):
        assert f"skipping step_{step}: " in said and f"step_{step}/__{victim}_0.distcp: corrupt" in said, said
    assert "resumed from" in said and "step_1 at step 1" in said
    step1 = [sorted(e.split("/")[1] for e in g["resume"] if e.startswith("step_1/")) for g in got]
    assert sorted(sum(step1, [])) == sorted(manifest)  # every file once, in four shares
    assert all(step1)


# ---------------------------------------------------------------------------------------------
# Disk estimate and the hand-off options (one process)


def test_disk_estimate_for_qwen3_30b_warns_on_a_512_gb_disk(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from pithtrain.checkpoint.dcp import disk_estimate
    from pithtrain.config import load_config
    from pithtrain.metrics import param_counts
    from pithtrain.models import build_model

    cfg = load_config("qwen3-30b-a3b", ["train.device=cpu", f"log.run_dir={tmp_path}/run", "train.steps=1000",
                                        "checkpoint.every=100", "checkpoint.keep_last=2"])
    total, _ = param_counts(build_model(cfg.model, init=False), cfg.model)
    assert 30.4e9 < total < 30.6e9
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(0, 0, 512e9))
    line = disk_estimate(cfg, total)
    per_save = 12 * total  # float32 weights + AdamW's two moments
    assert f"{per_save / 1e9:.2f} GB per save" in line and f"peak {3 * per_save / 1e9:.2f} GB" in line
    assert "warning: the run directory's filesystem has 512.0 GB free" in line
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(0, 0, 2e12))
    assert "warning" not in disk_estimate(cfg, total)
    cfg.checkpoint.every, cfg.checkpoint.every_minutes, cfg.checkpoint.final = 0, 0, False
    assert disk_estimate(cfg, total) is None


@pytest.mark.parametrize("policy, saves", [
    (["checkpoint.every=100"], 3),  # 10 saves, keep_last 2: two kept + the one being written
    (["checkpoint.every=400", "checkpoint.keep_last=5"], 3),  # steps 400, 800 and the final 1000
    (["checkpoint.every=0"], 1),  # the final save alone
    (["checkpoint.every=0", "checkpoint.every_minutes=30"], 3),  # the clock's saves: as many as it makes
    (["checkpoint.every=0", "checkpoint.every_minutes=30", "checkpoint.final=false"], 3),
    (["checkpoint.every=0", "checkpoint.final=false"], 0),  # nothing saved: no line
])
def test_disk_estimate_counts_the_saves_the_policy_keeps(tmp_path, monkeypatch, policy, saves):
    """It counted checkpoint.every's saves only: a run saving by the clock (the large recipes) was
    one save, or none, where keep_last + 1 will exist."""
    from pithtrain.checkpoint.dcp import disk_estimate
    from pithtrain.config import load_config

    cfg = load_config(None, ["train.steps=1000", "checkpoint.keep_last=2", f"log.run_dir={tmp_path}", *policy])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = disk_estimate(cfg, 10**9)  # 12 GB a save
    if saves == 0:
        assert line is None
        return
    assert f"peak {12 * saves:.2f} GB on disk ({saves} saves: keep_last=" in line, line
    assert "host memory" not in line  # CPU: saves are synchronous


def test_disk_estimate_says_an_asynchronous_save_stages_the_state_in_host_memory(tmp_path, monkeypatch):
    from pithtrain.checkpoint.dcp import disk_estimate
    from pithtrain.config import load_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = load_config(None, [f"log.run_dir={tmp_path}", "checkpoint.every=10"])
    assert "an asynchronous save first copies it to host memory (12.00 GB over the ranks)" in disk_estimate(cfg, 10**9)
    cfg.checkpoint.async_save = False
    assert "host memory" not in disk_estimate(cfg, 10**9)


def test_final_export_and_weights_only_hand_off(tmp_path):
    import pytest
    transformers = pytest.importorskip("transformers")

    from pithtrain.checkpoint.dcp import CheckpointError, SafeReader
    from pithtrain.config import ConfigError, load_config
    from pithtrain.train import train

    run = tmp_path / "run"
    args = TINY + ["model.num_layers=4", "train.steps=2", "train.device=cpu", f"log.run_dir={run}",
                   "checkpoint.weights_only=true", "checkpoint.export_hf=true", "checkpoint.export_dtype=float32"]
    _, model = train(load_config(None, args), resume=False)
    keys = SafeReader(run / "checkpoints" / "step_2").read_metadata().state_dict_metadata
    assert keys and all(k.startswith("model.") for k in keys)  # no optimizer moments, no RNG
    theirs = transformers.AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    assert theirs.dtype == torch.float32
    x = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, model.eval()(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(CheckpointError, match="weights_only"):
        train(load_config(None, args[:-3] + ["train.steps=3"]), resume=True)
    with pytest.raises(ConfigError, match="checkpoint.export_hf: acts on the final save"):
        load_config(None, TINY + ["checkpoint.export_hf=true", "checkpoint.final=false"])
    # The same checkpoint exported by torchrun with 2 ranks (each writes every other shard) is
    # byte for byte a one-process export.
    import subprocess
    import sys

    from pithtrain.checkpoint.export import export
    export(run, tmp_path / "one", torch.float32, 1 << 20)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "pithtrain.checkpoint.export", "--ckpt", str(run), "--out",
           str(tmp_path / "two"), "--dtype", "float32", "--shard-mb", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    one = sorted(f.name for f in (tmp_path / "one").iterdir())
    assert len([f for f in one if f.endswith(".safetensors")]) >= 2
    assert one == sorted(f.name for f in (tmp_path / "two").iterdir())
    for f in one:
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes(), f


# ---------------------------------------------------------------------------------------------
# The asynchronous save on 2 gloo ranks (issue 52): its collectives run on DCP's background thread
# while the main thread's step boundary and evaluation agree on notices


ASYNC_STEPS, ASYNC_SEEDS = 4, (0, 1, 2)


def _init_gloo(rank: int, world: int, port: int, timeout_s: float = 20.0):
    """A gloo group whose collectives (and every group made after it) fail after `timeout_s`: a
    mismatched collective fails the test instead of hanging it."""
    import datetime

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    c10d.default_pg_timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=c10d.default_pg_timeout)
    return dist


def _async_worker(rank: int, world: int, port: int, tmp: str):
    """Every step saves asynchronously (the CUDA path, forced on CPU as tests/test_checkpoint.py's
    async-then-fail test does); each rank's shards take a random time to write, so one rank's
    background exchange comes before its step boundary and another's after. Per seed, one rank
    gets SIGTERM while a save is being written; the run stops at an agreed step, resumes, and
    every loss equals the uninterrupted run's."""
    import functools
    import random
    import signal
    import time

    import pithtrain.checkpoint.dcp as dcp_mod
    import pithtrain.data
    from pithtrain.checkpoint.dcp import step_dirs, verify
    from pithtrain.config import load_config
    from pithtrain.reliability import Ended
    from pithtrain.train import train

    pithtrain.data.stdlib_tokens = functools.lru_cache(pithtrain.data.stdlib_tokens)  # read once per process
    dist = _init_gloo(rank, world, port)
    init, write = dcp_mod.Checkpointer.__init__, dcp_mod.FileSystemWriter.write_data
    trial = {"rng": random.Random(f"ref-{rank}"), "notice": None}

    def async_init(self, *args):
        init(self, *args)
        self.use_async = True

    def slow_write(self, *args, **kwargs):  # DCP's background thread
        time.sleep(trial["rng"].choice((0.0, 0.05, 0.2)))
        if trial["notice"] == Path(str(self.path)).name:
            trial["notice"] = None
            os.kill(os.getpid(), signal.SIGTERM)
        return write(self, *args, **kwargs)

    dcp_mod.Checkpointer.__init__, dcp_mod.FileSystemWriter.write_data = async_init, slow_write
    extra = ["parallel.fsdp=2", "train.device=cpu", "log.every=1", "log.tensorboard=false", "checkpoint.every=1",
             "checkpoint.keep_last=2", "train.eval_every=2", "train.eval_batches=2", f"train.steps={ASYNC_STEPS}"]

    def cfg(run):
        return load_config(None, TINY + variant.overrides() + extra + [f"log.run_dir={run}"])

    ref, _ = train(cfg(f"{tmp}/ref"))
    out = {"ref": [h["loss"] for h in ref], "trials": []}
    for seed in ASYNC_SEEDS:
        pick = random.Random(seed)  # the same on every rank: which rank, which save
        victim, at = pick.randrange(world), pick.randint(1, ASYNC_STEPS - 2)
        trial["rng"] = random.Random(f"{seed}-{rank}")  # each rank its own write times
        trial["notice"] = f".tmp-step_{at}" if rank == victim else None
        run = f"{tmp}/seed{seed}"
        try:
            train(cfg(run))
            code = 0
        except Ended as e:
            code = e.code
        kept = step_dirs(Path(run) / "checkpoints")
        stopped = int(kept[0].name.removeprefix("step_"))
        if rank == 0:
            verify(kept[0])
        rest, _ = train(cfg(run))
        out["trials"].append({"seed": seed, "at": at, "code": code, "stopped": stopped,
                              "resumed": [h["step"] for h in rest]})
        if rank == 0:
            recs = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
            out["trials"][-1]["losses"] = [r["loss"] for r in sorted(recs, key=lambda r: r["step"])]
    Path(tmp, f"async.{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_async_saves_every_step_with_notices_during_them_agree_and_resume_bit_exact(tmp_path):
    spawn(_async_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    got = [json.loads((tmp_path / f"async.{r}.json").read_text()) for r in range(2)]
    assert got[0]["trials"][0]["resumed"] == got[1]["trials"][0]["resumed"]
    for t0, t1 in zip(got[0]["trials"], got[1]["trials"]):
        assert t0["code"] == t1["code"] == 143 and t0["stopped"] == t1["stopped"], (t0, t1)
        # the notice came while step `at`'s save was written: the step boundary after `at` + 1 or
        # `at` + 2 (the rank's write may outlast a step) saw it, on both ranks alike
        assert t0["at"] + 1 <= t0["stopped"] <= t0["at"] + 2, t0
        assert t0["resumed"] == list(range(t0["stopped"] + 1, ASYNC_STEPS + 1)), t0
        assert t0["losses"] == got[0]["ref"], t0  # bit for bit


# ---------------------------------------------------------------------------------------------
# A malformed manifest, or a check only one rank fails, on 2 gloo ranks (issue 52): every rank
# raises the same CheckpointError, and resume skips the checkpoint by name


def _malform(ckpt: Path, how: str):
    """Rewrite `ckpt`'s manifest.json as `how` says (rank 0, before the others resume)."""
    from pithtrain.checkpoint.dcp import MANIFEST, _share

    path = ckpt / MANIFEST
    text = path.read_text()
    m = json.loads(text)
    files = m["files"]
    if how == "truncated":
        path.write_text(text[: len(text) // 2])
        return
    if how.startswith("no sha256, rank "):  # a file only that rank hashes at verification
        del files[_share(files, int(how[-1]), 2)[0]]["sha256"]
    elif how == "no size":
        del files["trainer.json"]["size"]
    elif how == "sha256 a number":
        files["recipe.yaml"]["sha256"] = 12345
    elif how == "size a string":
        files["recipe.yaml"]["size"] = str(files["recipe.yaml"]["size"])
    elif how == "files a list":
        m["files"] = list(files)
    elif how == "a name outside":
        files["../x"] = files.pop("recipe.yaml")
    path.write_text(json.dumps(m))


MALFORMED = ("truncated", "no sha256, rank 1", "no sha256, rank 0", "no size", "sha256 a number", "size a string",
             "files a list", "a name outside")


def _malformed_worker(rank: int, world: int, port: int, tmp: str):
    import pithtrain.checkpoint.dcp as dcp_mod
    from pithtrain.checkpoint.dcp import CheckpointError
    from pithtrain.config import load_config
    from pithtrain.train import train

    dist = _init_gloo(rank, world, port)
    run, steps = Path(tmp, "run"), len(MALFORMED) + 1
    args = TINY + variant.overrides() + ["parallel.fsdp=2", "train.device=cpu", "log.tensorboard=false",
                                         f"train.steps={steps}", f"log.run_dir={run}"]
    train(load_config(None, args + ["checkpoint.every=1", f"checkpoint.keep_last={steps}"]))
    dist.barrier()
    if rank == 0:  # step_1 stays whole; each newer one has its manifest malformed another way
        for step, how in zip(range(steps, 1, -1), MALFORMED):
            _malform(run / "checkpoints" / f"step_{step}", how)
    dist.barrier()
    out = {}
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        hist, _ = train(load_config(None, args))
    out["resumed"], out["said"] = [h["step"] for h in hist], said.getvalue()
    # a check of the checkpoint that fails on rank 1 alone (as a missing tensor only one pipeline
    # stage holds would): both ranks raise it, none waits in DCP's load for the other
    real = dcp_mod.check_index

    def only_rank_1(ckpt, keys):
        if rank == 1:
            raise CheckpointError(f"{ckpt}: rank 1's own check failed")
        return real(ckpt, keys)

    dcp_mod.check_index = only_rank_1
    try:
        train(load_config(None, args + [f"train.steps={steps + 1}"]))
        out["one rank"] = "no error"
    except CheckpointError as e:
        out["one rank"] = str(e)
    finally:
        dcp_mod.check_index = real
    Path(tmp, f"malformed.{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_a_malformed_manifest_or_one_ranks_failed_check_is_the_same_error_on_every_rank(tmp_path):
    spawn(_malformed_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    got = [json.loads((tmp_path / f"malformed.{r}.json").read_text()) for r in range(2)]
    steps = len(MALFORMED) + 1
    assert got[0]["resumed"] == got[1]["resumed"] == list(range(2, steps + 1))  # from step_1, on both ranks
    said = got[0]["said"]
    for step in range(steps, 1, -1):
        line = next(x for x in said.splitlines() if f"skipping step_{step}: " in x)
        assert f"step_{step}/manifest.json: malformed manifest" in line, line
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'step_1'} at step 1" in said
    want = f"{tmp_path / 'run' / 'checkpoints' / f'step_{steps}'}: rank 1's own check failed"
    assert got[0]["one rank"] == got[1]["one rank"] == want
