"""Gloo ranks for the multi-process tests, forked from a clean server that has imported torch and
pithtrain once (multiprocessing's forkserver, preloaded).

A spawned rank imports torch and pithtrain itself: about 3.5 s of CPU a rank on the 2-core CI
machine, over 50 ranks a suite. A rank forked from the test's own process would skip that but
inherit whatever earlier tests left there (process groups, device meshes, DTensor caches: FSDP
runs then disagree with one process), so ranks fork from the server instead, as clean as a spawned
process. They get the test's environment and directory at the call (the server keeps its own
from when it started): PYTEST_CURRENT_TEST names the test in a rank, as tests/variant.py needs."""

import multiprocessing.forkserver
import os

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed.tensor", "pithtrain.train", "pithtrain.checkpoint.dcp"]


def spawn(fn, args: tuple, nprocs: int) -> None:
    """fn(rank, *args) in nprocs processes; raises if any rank fails (mp.spawn's contract)."""
    multiprocessing.forkserver.set_forkserver_preload(PRELOAD)  # read when the server first starts
    mp.start_processes(_rank, args=(fn, dict(os.environ), os.getcwd(), *args), nprocs=nprocs, join=True,
                       start_method="forkserver")


def _rank(rank: int, fn, env: dict, cwd: str, *args) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fn(rank, *args)
