"""The GPUs PithTrain knows, in one table, and the one parser of a GPU's name.

    GPUS["h100"].memory_gib                # the memory plan's limit (pithtrain/plan.py)
    gpu_key("NVIDIA H100 80GB HBM3")       # "h100": CUDA's and nvidia-smi's names, or `--gpu h100`

Each entry: the recipe
overrides `invoke train --gpu` / `invoke plan --gpu` add after a recipe's own values (the recipe
stays the whole truth of a model; these are the per-GPU numerics: Blackwell trains FP8 as in the
paper's 1x8 B200 run, pithtrain/kernels/fp8_linear.py; on Hopper add train.fp8=true by hand, it is
slower there for now), memory as torch.cuda.get_device_properties().total_memory reports it, and
the datasheet figures of the performance model (pithtrain/perf.py) and MFU (pithtrain/metrics.py):
dense bf16 peak, HBM bandwidth, NVLink and network line rate per GPU and direction, GPUs per node.
Datasheets: H100 SXM 80 GB, 989 TFLOP/s, 3.35 TB/s, NVLink 4 450 GB/s; H200 141 GB, 989, 4.8, 450;
B200 180 GB, 2250, 8.0, NVLink 5 900; B300 288 GB (the same dense bf16); one 400 Gb/s HCA per GPU.
Which image a GPU runs in is the appliance's (tools/appliance.py GPU_TARGET: the image build runs
that file alone; tests/test_appliance.py keeps its GPUs these); it names GPUs with gpu_key too.
Stdlib only: tools/appliance.py imports it on a host without torch.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class GPU(NamedTuple):
    overrides: tuple  # recipe overrides, appended after the recipe's own values
    memory_gib: float
    peak_tflops: float  # dense bf16 (MFU's denominator, docs/bench.md)
    hbm_tbs: float
    nvlink_gbs: float
    network_gbs: float
    per_node: int


_BF16 = ("train.device=cuda", "train.dtype=bfloat16")
GPUS = {
    "h100": GPU(_BF16, 79.6, 989.0, 3.35, 450.0, 50.0, 8),
    "h200": GPU(_BF16, 140.4, 989.0, 4.8, 450.0, 50.0, 8),
    "b200": GPU((*_BF16, "train.fp8=true"), 179.1, 2250.0, 8.0, 900.0, 50.0, 8),
    "b300": GPU((*_BF16, "train.fp8=true"), 268.0, 2250.0, 8.0, 900.0, 50.0, 8),
}


def gpu_key(name: str) -> str | None:
    """GPUS's key for a GPU's name (`--gpu h100`, CUDA's or nvidia-smi's "NVIDIA H100 80GB HBM3"),
    else None. Whole words only: "NVIDIA GH200 480GB" (Grace Hopper, an arm64 host) is no h200."""
    return next((w for w in re.findall(r"[a-z0-9]+", name.lower()) if w in GPUS), None)
