"""FSDP layouts where each rank's routed experts are its own (parallel_dims.experts_alone, e.g.
fsdp=8 ep=8): FSDP leaves the experts out and they take one GPU's path, a bf16 copy kept across
micro-batches whose gradients go into the float32 DTensor master (precision.WeightCopies), in
place on a GPU (kernels/wgrad.py). Parity of whole layouts with one process: tests/test_distributed.py."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from pithtrain.precision import WeightCopies

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def one_rank():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DeviceMesh("cpu", [0])
    dist.destroy_process_group()


def test_a_dtensor_master_gets_a_plain_bf16_copy_and_its_gradient(one_rank):
    """The copy is the master's local block as a plain bf16 parameter (what the grouped GEMM and
    the in-place kernel take); two micro-batches' gradients sum into the master's float32 DTensor
    gradient; the master is back in its module after the step."""
    mod = nn.Module()
    mod.w = nn.Parameter(distribute_tensor(torch.randn(4, 3), one_rank, [Shard(0)]))
    master = mod.w
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    copies = WeightCopies("all")
    with copies.swap(mod):
        copy = mod.w
        assert type(copy) is nn.Parameter and copy.dtype == torch.bfloat16 and copy.shape == (4, 3)
        assert copies.master(copy) is master
        torch.testing.assert_close(copy.float(), master.to_local(), rtol=1e-2, atol=1e-2)
        for g in (a, b):
            (copy.float() * g).sum().backward()
    assert mod.w is master and isinstance(master.grad, DTensor) and master.grad.dtype == torch.float32
    assert master.grad.placements == master.placements
    want = a.to(torch.bfloat16).float() + b.to(torch.bfloat16).float()  # each micro-batch's bf16 gradient
    torch.testing.assert_close(master.grad.to_local(), want)


def calibrate_module():
    spec = importlib.util.spec_from_file_location("calibrate", REPO / "scripts" / "calibrate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.gpu
def test_fsdp_path_on_one_rank_computes_the_one_gpu_step():
    """FSDP2 on a one-rank mesh with the expert-parallel dispatcher (scripts/calibrate.py's fsdp
    path: the experts left out of FSDP, their bf16 copy and in-place gradients) against train.py's
    one-GPU step from the same weights and batch, 4 micro-batches a step: losses and every
    parameter after 3 AdamW steps within bf16 noise."""
    from pithtrain import bench

    cal = calibrate_module()
    dev = torch.device("cuda")
    cfg = bench.bench_config("qwen3-30b-a3b", 2, 2, 1024, 4, ["model.num_experts=16", "model.top_k=4"])
    ref_model, ref_step = cal.make(cfg, "train", dev)
    try:
        model, step = cal.make(cfg, "fsdp", dev)  # its one-rank process group, left below
        with torch.no_grad():
            for (n, p), (m, q) in zip(ref_model.named_parameters(), model.named_parameters()):
                assert n.replace("_fsdp_wrapped_module.", "") == m.replace("_fsdp_wrapped_module.", "")
                (q.to_local() if isinstance(q, DTensor) else q).copy_(p)
        losses = [(float(ref_step(4)), float(step(4))) for _ in range(3)]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    for a, b in losses:
        assert abs(a - b) <= 2e-3 * abs(a), losses
    for (n, p), q in zip(ref_model.named_parameters(), model.parameters()):
        q = q.full_tensor() if isinstance(q, DTensor) else q
        err = ((q - p).norm() / p.norm()).item()
        assert err < 2e-3, (n, err)
    assert sum(getattr(p, "wgrad_adds", 0) for p in model.parameters()) > 0  # the in-place path ran
