"""The k-grouped GEMM adding into its output, in Triton: grad[e] += x[rows of e]^T dy[rows of e].

Used by kernels/wgrad.py on CUDA (the expert weight gradients of micro-batches 2 and later, added
straight into the gradient they accumulate); the reference is torch's F.grouped_mm then add_
(tests/test_kernels_gpu.py; docs/perf-notes.md records how the tile configurations were chosen).

Loads go through TMA with one device-side tensor descriptor per expert: its rows [start, end) as a
(rows, D) tensor, so the hardware zero-fills the rows past the expert's end and the loop has no
masks. A bf16 gradient is handled by a persistent kernel (one program per SM walking the tiles)
whose accumulator starts from the gradient tile, loaded before the main loop; a float32 gradient
tile is twice the shared memory, so there one program per tile adds it after the loop; a float32
master's first micro-batch (kernels/wgrad.py) is written without reading it, by one program per SM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tile(x_ptr, dy_ptr, c_ptr, offs_ptr, e, pm, pn, D, N, sx, sdy, BM: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, INIT_C: tl.constexpr, ADD: tl.constexpr):
    """c[e, m-tile pm, n-tile pn] += x[rows of e, m-tile]^T @ dy[rows of e, n-tile] (ADD: False:
    c = ..., written without reading it; an expert without rows gets zeros)."""
    start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0).to(tl.int64)
    end = tl.load(offs_ptr + e).to(tl.int64)
    cd = tl.make_tensor_descriptor(c_ptr + e.to(tl.int64) * D * N, shape=[D, N], strides=[N, 1],
                                   block_shape=[BM, BN])
    if end > start:
        rows = (end - start).to(tl.int32)
        xd = tl.make_tensor_descriptor(x_ptr + start * sx, shape=[rows, D], strides=[sx, 1], block_shape=[BK, BM])
        dyd = tl.make_tensor_descriptor(dy_ptr + start * sdy, shape=[rows, N], strides=[sdy, 1],
                                        block_shape=[BK, BN])
        if INIT_C:
            acc = cd.load([pm * BM, pn * BN]).to(tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, rows, BK):
            acc = tl.dot(xd.load([k, pm * BM]).T, dyd.load([k, pn * BN]), acc)
        if ADD and not INIT_C:
            acc += cd.load([pm * BM, pn * BN]).to(tl.float32)
        cd.store([pm * BM, pn * BN], acc.to(c_ptr.dtype.element_ty))
    elif not ADD:  # adding, an expert without rows leaves its gradient as it is
        cd.store([pm * BM, pn * BN], tl.zeros((BM, BN), dtype=c_ptr.dtype.element_ty))


@triton.jit
def _wgrad_accum_kernel(x_ptr, dy_ptr, c_ptr, offs_ptr, E, D, N, sx, sdy, PROGRAMS: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INIT_C: tl.constexpr,
                        ADD: tl.constexpr):
    """PROGRAMS = 0: one program per tile, the experts on grid axis 1; else PROGRAMS programs, program
    p taking tiles p, p + PROGRAMS, ... in expert-major order. Either way one expert's rows stay in
    L2 while its tiles run."""
    num_n = tl.cdiv(N, BN)
    if PROGRAMS == 0:
        _tile(x_ptr, dy_ptr, c_ptr, offs_ptr, tl.program_id(1), tl.program_id(0) // num_n,
              tl.program_id(0) % num_n, D, N, sx, sdy, BM, BN, BK, INIT_C, ADD)
    else:
        per_e = tl.cdiv(D, BM) * num_n
        for tile in tl.range(tl.program_id(0), E * per_e, PROGRAMS):
            t = tile % per_e
            _tile(x_ptr, dy_ptr, c_ptr, offs_ptr, tile // per_e, t // num_n, t % num_n, D, N, sx, sdy,
                  BM, BN, BK, INIT_C, ADD)


# (BM, BN, BK, warps, stages, gradient tile loaded first, programs per SM (0: one per tile)) by the
# gradient's dtype, and "write" for a float32 gradient written without reading it (add=False): the
# fastest summed over the three families' expert shapes on the H200 (a probe of tile configurations,
# since deleted; its figures are in docs/perf-notes.md).
CONFIGS = {torch.bfloat16: (128, 256, 64, 8, 3, True, 1), torch.float32: (128, 128, 64, 4, 3, False, 0),
           "write": (128, 128, 64, 4, 3, False, 1)}


def _scratch(size: int, alignment: int, stream):
    """Global memory for the device-side tensor descriptors (128 bytes each), from torch's caching
    allocator on the current device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def add_kgrouped(grad_EDN: torch.Tensor, x_XD: torch.Tensor, dy_XN: torch.Tensor, offs_E: torch.Tensor,
                 config: tuple | None = None, add: bool = True) -> None:
    """grad[e] += x[rows of e]^T dy[rows of e] in place (rows sorted by expert, offs_E the
    cumulative end row of each expert); grad float32 or bf16 and contiguous; a Hopper or later GPU.
    add=False: grad[e] = x[rows of e]^T dy[rows of e], grad not read (a float32 master's first
    micro-batch: configurations that add after the loop only).
    TMA's rules (16-byte aligned bases and row strides, unit inner strides) are torch's grouped
    GEMM's too."""
    E, D, N = grad_EDN.shape
    assert grad_EDN.is_contiguous() and grad_EDN.dtype in CONFIGS and x_XD.stride(1) == 1 and dy_XN.stride(1) == 1
    assert add or grad_EDN.dtype == torch.float32
    assert all(t.data_ptr() % 16 == 0 and (t.stride(-2) * t.element_size()) % 16 == 0 for t in (grad_EDN, x_XD, dy_XN))
    bm, bn, bk, warps, stages, init_c, per_sm = config or CONFIGS[grad_EDN.dtype if add else "write"]
    assert add or not init_c, "writing without reading needs a configuration that adds after the loop"
    programs = per_sm * torch.cuda.get_device_properties(grad_EDN.device).multi_processor_count
    grid = (programs,) if per_sm else (triton.cdiv(D, bm) * triton.cdiv(N, bn), E)
    triton.set_allocator(_scratch)  # a context variable: set in the thread that launches (autograd's)
    _wgrad_accum_kernel[grid](x_XD, dy_XN, grad_EDN, offs_E, E, D, N, x_XD.stride(0), dy_XN.stride(0),
                              PROGRAMS=programs, BM=bm, BN=bn, BK=bk, INIT_C=init_c, ADD=add, num_warps=warps,
                              num_stages=stages)
