"""The run directory: one writer at a time, and storage checked before the first step.

    lock = claim(cfg, n_params)     # rank 0, before the model is built; lock.close() when done

`claim` takes an OS lock on `<log.run_dir>/.lock` (fcntl.lockf: held by this process, released by
the kernel on any exit, so a lock left by a dead process never blocks), writes the holder's host,
pid and start time into it for the message a second trainer prints, then checks that the run and
checkpoint directories are writable and that their file system has room for the next checkpoint.
Each problem is one ConfigError line with the path and the numbers.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import shutil
import socket
from pathlib import Path

from pithtrain.config import ConfigError

LOCK = ".lock"
# fp32 parameter + AdamW's two fp32 moments, per parameter; DCP's index, RNG states and the JSON
# files are small beside them, and 10% covers them and the file system's own blocks.
CKPT_BYTES_PER_PARAM = 12
CKPT_MARGIN = 1.1


def claim(cfg, n_params: int):
    """Lock log.run_dir for this run and check it can hold the run's output; returns the open
    lock file (closing it releases the lock)."""
    run_dir = Path(cfg.log.run_dir)
    _writable(run_dir, "log.run_dir")
    f = _lock(run_dir)
    try:
        ckpt_dir = run_dir / "checkpoints"
        if cfg.checkpoint.every or cfg.checkpoint.final:
            _writable(ckpt_dir, "log.run_dir")
            need = int(n_params * CKPT_BYTES_PER_PARAM * CKPT_MARGIN)
            free = shutil.disk_usage(ckpt_dir).free
            if free < need:
                raise ConfigError(
                    f"log.run_dir: {ckpt_dir} has {_size(free)} free; the next checkpoint needs about "
                    f"{_size(need)} ({n_params:,} parameters x {CKPT_BYTES_PER_PARAM} bytes of weights and "
                    "optimizer state); free space or choose another log.run_dir")
    except BaseException:
        f.close()
        raise
    return f


def _lock(run_dir: Path):
    path = run_dir / LOCK
    f = open(path, "a+")  # not "w": truncating before holding the lock would erase the holder's line
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        holder = (path.read_text(errors="replace").strip().splitlines() or
                  ["a process that has not written its name yet"])[0][:200]
        raise ConfigError(f"log.run_dir: {run_dir} is in use by another trainer ({holder}; lock {path}); "
                          "wait for it to finish or choose another log.run_dir") from None
    f.truncate(0)
    f.write(f"host {socket.gethostname()} pid {os.getpid()} since "
            f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}\n")
    f.flush()
    return f


def _writable(path: Path, key: str):
    """Create `path` and write, sync and remove a probe file in it."""
    probe = path / f".write-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{key}: {path} is not writable ({e.strerror or e}); "
                          "fix its permissions or choose another log.run_dir") from None


def _size(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
