"""The asynchronous save on one GPU (run on the lent H200: `pytest -m gpu tests/test_checkpoint_gpu.py`).

A run with an asynchronous save every 2 steps (checkpoint.async_save, on by default on CUDA) gets
SIGTERM while DCP's background thread writes step 4's save: it ends cleanly (exit 143, one line,
the agreed step saved and verified), and the resumed run's losses equal an uninterrupted run's bit
for bit. The multi-rank half runs on gloo (tests/test_checkpoint_ranks.py, the async saves with
notices during them).
"""

import re
import subprocess
import sys

import pytest
import torch
from test_checkpoint import SUB_ENV, TINY, losses

from pithtrain.checkpoint.dcp import resolve, verify

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SIGTERM_IN_ASYNC_WRITE = """
import os, signal, sys, threading, time
from pathlib import Path
from pithtrain.checkpoint import dcp
from pithtrain.train import main
write = dcp.FileSystemWriter.write_data

def late(self, *a, **kw):  # step 4's save, written while the main thread trains on (step 5, 6 or 7 stops)
    if Path(str(self.path)).name == ".tmp-step_4":
        Path(sys.argv[1]).write_text(threading.current_thread().name)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
    return write(self, *a, **kw)

dcp.FileSystemWriter.write_data = late
sys.exit(main(sys.argv[2:]))
"""


def test_sigterm_during_an_asynchronous_save_ends_cleanly_and_resumes_bit_exact(tmp_path):
    args = TINY + ["train.device=cuda", "train.steps=8", "checkpoint.every=2", "log.every=1", "log.tensorboard=false"]

    def run(name, *cmd):
        return subprocess.run([sys.executable, *cmd, *args, f"log.run_dir={tmp_path / name}"], capture_output=True,
                              text=True, timeout=300, env=SUB_ENV)

    for name in ("A", "A2"):
        p = run(name, "-m", "pithtrain.train")
        assert p.returncode == 0, p.stderr[-3000:]
    if losses(tmp_path / "A") != losses(tmp_path / "A2"):  # then no resume could be bit-exact
        pytest.fail(f"two uninterrupted CUDA runs differ: {losses(tmp_path / 'A')} vs {losses(tmp_path / 'A2')}")
    p = run("B", "-c", SIGTERM_IN_ASYNC_WRITE, str(tmp_path / "thread"))
    assert p.returncode == 143, p.stderr[-3000:]
    assert (tmp_path / "thread").read_text() != "MainThread"  # the save was asynchronous
    stop = re.search(r"pithtrain: stopped at step ([5-7]) by SIGTERM; saved step_\1; run again to resume", p.stdout)
    assert stop and "Traceback" not in p.stderr, p.stdout[-3000:] + p.stderr[-3000:]
    ckpt = resolve(tmp_path / "B")
    assert ckpt.name == f"step_{stop.group(1)}" and verify(ckpt)["step"] == int(stop.group(1))
    p = run("B", "-m", "pithtrain.train")
    assert p.returncode == 0 and f"resumed from {ckpt} at step {stop.group(1)}" in p.stdout, p.stderr[-3000:]
    assert losses(tmp_path / "B") == losses(tmp_path / "A")  # bit for bit, steps 1-8
