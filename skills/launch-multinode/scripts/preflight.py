"""Multi-node preflight: rendezvous, then every collective PithTrain uses, checked for exact values.
Prints PASS or FAIL.

    python skills/launch-multinode/scripts/preflight.py                  # one node: --standalone, 2 processes
    python skills/launch-multinode/scripts/preflight.py --nproc 8        # one node, 8 GPUs (NCCL)
    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NNODES=2 NODE_RANK=0 \\
        python skills/launch-multinode/scripts/preflight.py --nproc 8    # on every node (NODE_RANK 0, 1)

Without RANK in the environment it launches itself through torchrun (python -m torch.distributed.run):
standalone for one node, or the c10d rendezvous that `invoke launch` uses when MASTER_ADDR,
MASTER_PORT, NNODES and NODE_RANK are set (tools/appliance.py checks them and says what is
missing). Each rank then runs, on NCCL (GPU) or Gloo (CPU): all_reduce, all_gather of host names,
broadcast, all_to_all_single (expert-parallel dispatch), all_gather_into_tensor (FSDP), a
barrier, and a bandwidth probe. Rank 0 prints the layout (hosts, ranks per host) and the verdict.
PASS: every value is exact on every rank and the launcher exits 0. Exit status 0 / 1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------------------------------------
# Launcher (this node)


def launch(nproc: int, timeout: int) -> int:
    """Run this script under torchrun on this node; the exit status is the job's."""
    from tools import appliance as ap

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if os.environ.get("MASTER_ADDR") or os.environ.get("NNODES"):
        try:
            env = ap.multinode_env(os.environ)  # the same variables and checks as `invoke launch`
        except ap.ApplianceError as e:
            print(f"error: {e}\nFAIL")
            return 1
        cmd += [f"--nnodes={env['NNODES']}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={env['MASTER_ADDR']}:{env['MASTER_PORT']}", f"--rdzv-id={env['RUN_ID']}-preflight",
                f"--rdzv-conf=is_host={'true' if env['NODE_RANK'] == '0' else 'false'},join_timeout={timeout}"]
    else:
        cmd.append("--standalone")
    cmd += [str(Path(__file__).resolve()), f"--timeout={timeout}"]
    print("+ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd)
    if r.returncode != 0:
        print(f"launcher exited {r.returncode}\nFAIL")
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# Worker (one rank)


def worker(timeout: int) -> int:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # newer torch renames *_into_tensor
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []

    def expect(name, got, want):
        if not torch.equal(got.cpu(), want.cpu()):
            problems.append(f"rank {rank}: {name}: got {got.tolist()}, expected {want.tolist()}")

    x = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(x)
    expect("all_reduce", x, torch.tensor([world * (world + 1) / 2]))

    hosts = [None] * world
    dist.all_gather_object(hosts, (socket.gethostname(), local, str(device)))

    b = torch.tensor([rank * 10.0], device=device)
    dist.broadcast(b, src=0)
    expect("broadcast", b, torch.tensor([0.0]))

    # all_to_all_single: rank r sends value 100*r + j to rank j, so rank r receives 100*i + r from i
    send = torch.tensor([100.0 * rank + j for j in range(world)], device=device)
    recv = torch.empty(world, device=device)
    dist.all_to_all_single(recv, send)
    expect("all_to_all_single", recv, torch.tensor([100.0 * i + rank for i in range(world)]))

    # all_gather_into_tensor: FSDP's parameter gather
    full = torch.empty(world * 2, device=device)
    dist.all_gather_into_tensor(full, torch.tensor([2.0 * rank, 2.0 * rank + 1], device=device))
    expect("all_gather_into_tensor", full, torch.arange(world * 2, dtype=torch.float32))

    probe = torch.ones(16 * 2**20 // 4, device=device)  # 16 MiB
    dist.all_reduce(probe)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(probe)
    if cuda:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 3
    busbw = 2 * (world - 1) / world * probe.numel() * 4 / dt / 1e9 if world > 1 else float("nan")
    expect("all_reduce 16 MiB", probe[:1], torch.tensor([float(world) ** 4]))

    reports = [None] * world
    dist.all_gather_object(reports, problems)
    dist.destroy_process_group()
    if rank != 0:
        return 1 if problems else 0
    by_host = {}
    for h, lr, dev in hosts:
        by_host.setdefault(h, []).append(f"{lr}:{dev}")
    print(f"preflight: backend {backend}, world {world}, {len(by_host)} host(s)")
    for h, ranks in by_host.items():
        print(f"  {h}: {len(ranks)} process(es)  {' '.join(ranks)}")
    print(f"  all_reduce 16 MiB: {dt * 1e3:.2f} ms, bus bandwidth {busbw:.2f} GB/s (information, not judged)")
    all_problems = [p for r in reports for p in r]
    for p in all_problems:
        print(f"  problem: {p}")
    print("FAIL" if all_problems else "PASS", flush=True)
    return 1 if all_problems else 0


# ---------------------------------------------------------------------------------------------
# Entry point


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=0,
                   help="processes on this node (default: every visible GPU, or 2 on CPU)")
    p.add_argument("--timeout", type=int, default=300, help="seconds to wait for peers and collectives")
    args = p.parse_args(argv)
    if "RANK" in os.environ:
        return worker(args.timeout)
    import torch

    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    return launch(nproc, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
