"""What a run does when the machine sends a notice or a collective stops answering (docs/reliability.md).

    notice = Notice(cfg.checkpoint.on_signal)   # train(): first thing; notice.close() when it returns
    ... at each step boundary: agreed over the ranks (reductions.any_rank), then save and Ended
    diagnose(e, cfg, rank, world, step)          # a collective that timed out: the file and one line

A notice (checkpoint.on_signal, SIGTERM and SIGUSR1 by default, and SIGINT) only records its signal;
the trainer asks every rank at the next step boundary, so the rank that got it and the ones that did
not save the same step. A second notice while the first is being honoured ends the process at once
(exit 128 + the signal's number, no traceback): the atomic commit (checkpoint/dcp.py) leaves the
newest committed checkpoint valid whatever the save was doing.

The NCCL flight recorder (the ring of each rank's last collectives, dumped on a timeout) is turned on
here for every launch path (images/Dockerfile sets the same variables); its files go to
<run_dir>/flight-recorder/.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from pathlib import Path

FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
HANG_EXIT = 3  # a collective timed out (a rank stopped answering): the diagnosis names it


class Ended(Exception):
    """train() ended early, its one line printed: after a notice and its save (code 128 + the
    signal's number), or a collective that timed out (HANG_EXIT); main() returns `code`."""

    def __init__(self, code: int, line: str):
        super().__init__(line)
        self.code = code


class Notice:
    """Records the first notice; a second one ends the process at once."""

    def __init__(self, names: list[str]):
        self.signum, self.old = 0, {}
        if threading.current_thread() is not threading.main_thread():  # signal.signal needs it
            return
        for name in dict.fromkeys(["SIGINT", *names]):
            s = signal.Signals[name]
            self.old[s] = signal.signal(s, self._on)

    def _on(self, signum, frame):
        if self.signum:
            print(f"pithtrain: second {signal.Signals(signum).name}: stopped at once, without saving; "
                  "the last committed checkpoint is valid", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum = signum

    def close(self):
        for s, old in self.old.items():
            signal.signal(s, old)
        self.old = {}


def flight_recorder(run_dir: str):
    """Turn the NCCL flight recorder on (unless the environment already set it), dumping into
    <run_dir>/flight-recorder/ (read before the process group is made)."""
    for k, v in FLIGHT_RECORDER.items():
        os.environ.setdefault(k, v)
    d = Path(run_dir) / "flight-recorder"
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in os.environ:
        d.mkdir(parents=True, exist_ok=True)
        os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(d / "rank_")


def collective_failure(e: BaseException) -> bool:
    """A collective that timed out or lost its peer: gloo's plain RuntimeError or torch's DistError
    (NCCL), saying so in words (a CheckpointError, also a RuntimeError, is not one)."""
    import torch.distributed as dist
    text = str(e).lower()
    return (type(e) is RuntimeError or isinstance(e, dist.DistError)) and any(w in text for w in (
        "timed out", "timeout", "connection closed by peer", "connection reset", "broken pipe"))


def diagnose(e: BaseException, run_dir: str, rank: int, world: int, step: int, timeout_s: float) -> str:
    """Write <run_dir>/hang/rank<R>.txt (the collective, its caller, the step, the error, the stack)
    and return the one line to print."""
    frames = traceback.extract_tb(e.__traceback__)
    torch_frames = [f for f in frames if f"{os.sep}torch{os.sep}distributed{os.sep}" in f.filename]
    ours = [f for f in frames if f"{os.sep}pithtrain{os.sep}" in f.filename]
    op = torch_frames[-1].name if torch_frames else "unknown"
    caller = f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].name}" if ours else "?"
    path = Path(run_dir) / "hang" / f"rank{rank}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"rank {rank} of {world}: collective {op} (called from {caller}) failed at step {step} "
                    f"(parallel.timeout_s {timeout_s:g})\nerror: {' '.join(str(e).split())[:2000]}\n\n"
                    + "".join(traceback.format_exception(e)))
    return (f"pithtrain: rank {rank}: collective {op} at step {step} failed (a rank stopped answering "
            f"within parallel.timeout_s={timeout_s:g}); see {path}")
