"""The grouped expert GEMM whose weight gradient accumulates in place across micro-batches.

With several micro-batches per optimizer step, autograd makes each micro-batch's expert weight
gradient dw[e] = x[rows of e]^T dy[rows of e] as a new tensor (torch's grouped GEMM) and then adds
it into p.grad: one more pass reading both and writing the sum. For the experts (most of the
parameters) that pass was 82 ms of a 1224 ms Qwen3 12-layer step at 8 micro-batches
(docs/perf-notes.md). Here the GEMM adds its result into the gradient itself (Megatron's
gradient-accumulation fusion, for the k-grouped GEMM): a Triton kernel (wgrad_triton.py) that loads
each output tile of the existing gradient, adds its float32 products and stores it back.

  first micro-batch  the gradient does not exist yet: autograd as before (torch's grouped GEMM
                     makes it; post-accumulate hooks fire, e.g. parallelize.bf16_weights moving
                     it into the float32 master)
  later ones         the tensor the gradient accumulates into exists: p.grad, or under
                     parallelize.bf16_weights its float32 master's .grad (`p.master`); the kernel
                     adds into it (float32 arithmetic, one rounding to its dtype) and autograd gets
                     None for the weight

Each gradient only when the engine wants it (torch._C._will_engine_execute_node), and the in-place
add only in a .backward() that will accumulate the weight's gradient: the pipeline's input-only pass
(DualPipeV's B: autograd.grad w.r.t. the phase's inputs, which may be leaves) computes no weight
gradient and leaves .grad alone, its weight pass (.backward(inputs=params)) computes no input
gradient, and autograd.grad w.r.t. the weight returns it as usual. Reference: models.common.grouped_mm
(autograd of F.grouped_mm), passed in by use_kernels (this module imports no model code);
tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.graph import get_gradient_edge

try:
    from pithtrain.kernels.wgrad_triton import add_kgrouped

    _HAVE_TRITON = True
except ImportError:  # no Triton (CPU machines): `accumulate` adds with torch's GEMM
    _HAVE_TRITON = False


def accumulate(grad_EDN: torch.Tensor, x_XD: torch.Tensor, dy_XN: torch.Tensor, offs_E: torch.Tensor) -> None:
    """grad[e] += x[rows of e]^T dy[rows of e] in place: the Triton kernel on CUDA (Hopper or later:
    kernels.configure turns wgrad on only there); elsewhere (CPU, float32: the tests of the autograd
    logic) the reference's GEMM and add."""
    if grad_EDN.is_cuda and _HAVE_TRITON:
        add_kgrouped(grad_EDN, x_XD, dy_XN, offs_E)
    else:
        grad_EDN.add_(F.grouped_mm(x_XD.t(), dy_XN, offs=offs_E))


def _target(w: torch.Tensor) -> torch.Tensor | None:
    """The gradient tensor w's gradient would be added into, when the kernel can add into it."""
    g = getattr(w, "master", w).grad
    ok = (g is not None and type(g) is torch.Tensor and g.device == w.device and g.is_contiguous()
          and g.shape == w.shape and g.dtype in (torch.float32, torch.bfloat16))
    return g if ok else None


def _will_run(node) -> bool:
    return torch._C._will_engine_execute_node(node)


class _GroupedMM(torch.autograd.Function):
    """x and w come in as views made for this call (grouped_mm), so their nodes are never leaves:
    the engine answers whether each gradient is wanted in every kind of backward. `param` (in a
    tuple: not an autograd input) is the parameter itself, whose AccumulateGrad node tells
    .backward() (it may accumulate) from autograd.grad() (it raises there: gradients are returned)."""

    @staticmethod
    def forward(ctx, x_XD, w_EDF, offs_E, param):
        (p,) = param
        ctx.save_for_backward(x_XD, offs_E)
        ctx.w = p  # its .grad (or its master's) is written in backward
        ctx.nodes = (get_gradient_edge(x_XD).node if x_XD.requires_grad else None,
                     get_gradient_edge(w_EDF).node if w_EDF.requires_grad else None,
                     get_gradient_edge(p).node if p.requires_grad else None)
        return F.grouped_mm(x_XD, w_EDF, offs=offs_E)

    @staticmethod
    def backward(ctx, dy_XF):
        x_XD, offs_E = ctx.saved_tensors
        w, (x_node, w_node, acc_node) = ctx.w, ctx.nodes
        dy_XF = dy_XF.contiguous()
        dx = dw = None
        if x_node is not None and _will_run(x_node):
            dx = F.grouped_mm(dy_XF, w.transpose(-2, -1), offs=offs_E)
        if w_node is not None and _will_run(w_node):
            try:
                accumulates = _will_run(acc_node)  # .backward(): AccumulateGrad adds into .grad
            except RuntimeError:  # autograd.grad(): the gradient is returned, .grad stays untouched
                accumulates = False
            g = _target(w) if accumulates else None
            if g is None:
                dw = F.grouped_mm(x_XD.t(), dy_XF, offs=offs_E)
            else:
                accumulate(g, x_XD, dy_XF, offs_E)
                owner = getattr(w, "master", w)
                owner.wgrad_adds = getattr(owner, "wgrad_adds", 0) + 1  # the witness: in_place_adds
        return dx, dw, None, None


def in_place_adds(model: torch.nn.Module) -> int:
    """Weight gradients added in place so far, counted on the parameters that own them (the bench
    reports it per step: the witness that the path ran, as fp8_linear.quantised for FP8)."""
    return sum(getattr(p, "wgrad_adds", 0) for p in model.parameters())


def grouped_mm(x_XD: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor, *, reference) -> torch.Tensor:
    """`reference` (models.common.grouped_mm, bound by use_kernels) with the same result, whose
    weight gradient accumulates in place from the second micro-batch on, where the kernel applies:
    CUDA, bf16 rows, a plain bf16 parameter (bf16 parameters, or parallelize.bf16_weights' copies
    inside a step) and autograd on; also CPU float32, for the tests of the autograd logic. Elsewhere
    (evaluation without gradients, float32 weights outside a step, widths torch's grouped GEMM
    cannot take) the reference itself: nothing accumulates there. kernels.configure turns it on
    only for CUDA runs whose steps meet these."""
    dtype_ok = x_XD.dtype == w_EDF.dtype == (torch.bfloat16 if x_XD.is_cuda else torch.float32)
    if (torch.is_grad_enabled() and dtype_ok and type(w_EDF) is torch.nn.Parameter
            and all(n % 8 == 0 for n in w_EDF.shape[1:])):
        x_XD = x_XD.contiguous()
        return _GroupedMM.apply(x_XD.view_as(x_XD), w_EDF.view_as(w_EDF), offs_E.to(torch.int32), (w_EDF,))
    return reference(x_XD, w_EDF, offs_E)
