"""Checkpoints at scale (issue 20): per-rank hashing at commit and resume on 4 gloo ranks."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp
import variant

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
    cfg = load_config(None, TINY + variant.overrides(TINY + LAYOUT) + LAYOUT + ["train.steps=5", "checkpoint.every=1", "checkpoint.keep_last=5",
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
        train(load_config(None, TINY + variant.overrides(TINY + LAYOUT) + LAYOUT + ["train.steps=5", f"log.run_dir={run}"]), resume=True)
    said = out.getvalue()
    Path(tmp, f"hash.{rank}.json").write_text(json.dumps({"save": saved, "resume": hashed, "said": said}))
    dist.destroy_process_group()


def test_every_rank_hashes_its_own_files_and_a_flipped_byte_is_named(tmp_path):
    mp.spawn(_hash_worker, args=(4, free_port(), str(tmp_path)), nprocs=4)
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
    cfg.checkpoint.every, cfg.checkpoint.final = 0, False
    assert disk_estimate(cfg, total) is None


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
