"""Untrusted inputs (checkpoints, token shards, hub directories, recipes) cannot run code and are
one-line errors; one run directory has one writer; storage problems fail before the first step."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pithtrain.checkpoint.dcp import CheckpointError, write_manifest
from pithtrain.train import main

TINY = ["train.micro_batch_size=2", "train.seq_len=32", "train.warmup_steps=1",
        "model.hidden_size=32", "model.num_heads=2", "model.head_dim=16", "model.num_experts=4",
        "model.moe_intermediate_size=32", "model.num_layers=1", "data.max_bytes=100000", "log.every=1"]
SUB_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    """4 steps, checkpoints at 2 and 4."""
    run = tmp_path_factory.mktemp("sec") / "run"
    assert main(TINY + ["train.steps=4", "checkpoint.every=2", f"log.run_dir={run}"]) == 0
    return run


def copy_run(run, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


# ---------------------------------------------------------------------------------------------
# A crafted DCP index cannot run code


def evil_metadata(marker: Path) -> bytes:
    """Protocol 4: STACK_GLOBAL('torch.distributed.checkpoint.metadata', 'os.system') + REDUCE.
    Pickle resolves the dotted name through the module's own `import os`."""
    def s(text: str) -> bytes:
        b = text.encode()
        return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE
    return (b"\x80\x04" + s("torch.distributed.checkpoint.metadata") + s("os.system") + b"\x93"
            + s(f"touch {marker}") + b"\x85" + b"R" + b".")


def plant(ckpt: Path, marker: Path):
    (ckpt / ".metadata").write_bytes(evil_metadata(marker))
    write_manifest(ckpt, int(ckpt.name.removeprefix("step_")))  # hashes are no signature: updated too


def test_crafted_dcp_index_runs_nothing_on_resume(run4, tmp_path, capsys):
    run, marker = copy_run(run4, tmp_path), tmp_path / "pwned"
    plant(run / "checkpoints" / "step_4", marker)
    assert main(TINY + ["train.steps=6", f"log.run_dir={run}"]) == 2
    assert not marker.exists()
    err = capsys.readouterr().err
    assert "unsafe" in err and "os.system" in err and len(err.strip().splitlines()) == 1


def test_crafted_dcp_index_runs_nothing_on_export(run4, tmp_path):
    run, marker = copy_run(run4, tmp_path), tmp_path / "pwned"
    plant(run / "checkpoints" / "step_4", marker)
    out = subprocess.run([sys.executable, "-m", "pithtrain.checkpoint.export", "--ckpt", str(run),
                          "--out", str(tmp_path / "hf")], capture_output=True, text=True, timeout=120,
                         env=SUB_ENV)
    assert not marker.exists()
    assert out.returncode == 2 and "unsafe" in out.stderr and "os.system" in out.stderr, out.stderr


def test_dcp_index_naming_a_file_outside_the_checkpoint_is_refused(run4, tmp_path):
    import pickle

    from pithtrain.checkpoint.dcp import SafeReader, _check_index
    ckpt = copy_run(run4, tmp_path) / "checkpoints" / "step_4"
    md = SafeReader(ckpt).read_metadata()
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../step_2/__0_0.distcp"
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        _check_index(ckpt, [])
