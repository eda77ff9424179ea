"""Weight gradients that accumulate in place across micro-batches: the experts' grouped GEMM,
the token embedding and the LM head.

With several micro-batches per optimizer step, autograd makes each micro-batch's weight gradient
as a new tensor and then adds it into p.grad: one more pass reading both and writing the sum. For
the experts (most of the parameters) that pass was 82 ms of a 1224 ms Qwen3 12-layer step at 8
micro-batches (docs/perf-notes.md). Here each op adds its result into the gradient itself
(Megatron's gradient-accumulation fusion):

  experts    a Triton k-grouped GEMM (wgrad_triton.py) that loads each output tile of the existing
             gradient, adds its float32 products and stores it back
  embedding  the rows of this micro-batch's tokens only (index_put_ with accumulate: sorted, so
             deterministic), where autograd makes a zero-filled (V, D) gradient and adds all of it
  LM head    linear_ce.py's dW, made in the forward, added scaled by the incoming gradient in one
             pass (autograd multiplies, then adds)

Where the gradient goes, per micro-batch (`target`):

  first micro-batch  bf16 parameters: autograd as before (its tensor becomes p.grad, no copy).
                     Where the run's precision keeps the gradient elsewhere (`copies`: its
                     `sink`, asked through `grad_into`): on a bf16 copy of a float32 master
                     (precision.WeightCopies) the op writes the master's .grad itself, on a lean
                     parameter of a step of several micro-batches its float32 buffer
                     (precision.LeanState); made there, written rather than added to, instead of
                     a bf16 gradient a hook would add into it
  later ones         the tensor the gradient accumulates into exists: p.grad, the master's
                     .grad or the lean buffer; the op adds into it (float32 arithmetic, one
                     rounding to its dtype) and autograd gets None for the weight

Each gradient only when the engine wants it (torch._C._will_engine_execute_node), and in place only
in a .backward() that will accumulate the weight's gradient: the pipeline's input-only pass
(DualPipeV's B: autograd.grad w.r.t. the phase's inputs, which may be leaves) computes no weight
gradient and leaves .grad alone, its weight pass (.backward(inputs=params)) computes no input
gradient, and autograd.grad w.r.t. the weight returns it as usual. Under FSDP (sharded DTensor
gradients) only the experts FSDP leaves out take it (their master is a DTensor over the ep mesh:
the op writes its local block; kernels.configure keeps the embedding's and head's off there). References:
models.common.grouped_mm (autograd of F.grouped_mm), F.embedding, linear_ce's own backward;
tests/test_kernels_gpu.py, tests/test_overlap.py.
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


def accumulate(grad_EDN: torch.Tensor, x_XD: torch.Tensor, dy_XN: torch.Tensor, offs_E: torch.Tensor,
               add: bool = True) -> None:
    """grad[e] += x[rows of e]^T dy[rows of e] in place (add=False: grad[e] = ..., every expert
    written, an expert without rows as zeros): the Triton kernel on CUDA (Hopper or later:
    kernels.configure turns wgrad on only there); elsewhere (CPU, float32: the tests of the autograd
    logic) the reference's GEMM and add."""
    if grad_EDN.is_cuda and _HAVE_TRITON:
        add_kgrouped(grad_EDN, x_XD, dy_XN, offs_E, add=add)
    elif add:
        grad_EDN.add_(F.grouped_mm(x_XD.t(), dy_XN, offs=offs_E))
    else:
        grad_EDN.copy_(F.grouped_mm(x_XD.t(), dy_XN, offs=offs_E))


def will_run(node) -> bool:
    return torch._C._will_engine_execute_node(node)


def grad_nodes(w_view: torch.Tensor, p: torch.Tensor) -> tuple:
    """In forward: the autograd nodes backward asks about, the weight view's (is its gradient
    wanted?) and the parameter's AccumulateGrad (does this backward accumulate into .grad?)."""
    return (get_gradient_edge(w_view).node if w_view.requires_grad else None,
            get_gradient_edge(p).node if p.requires_grad else None)


def owner(w: torch.Tensor, copies=None) -> torch.Tensor:
    """The parameter w's gradient accumulates in: the float32 master when w is its bf16 copy
    (`copies`: the run's precision.sink, bound by use_kernels), else w."""
    p = copies.master(w) if copies is not None else None
    return w if p is None else p


def target(w: torch.Tensor, acc_node, copies=None) -> tuple[torch.Tensor | None, bool]:
    """In backward, once w's gradient is wanted: (the tensor to add it into, False); on the first
    micro-batch where the run's sink keeps it (a bf16 copy's float32 master's .grad, lean's float32
    buffer: precision.py's grad_into) (that tensor, made empty, True: write it, do not add); else
    (None, False): return the gradient to autograd."""
    try:
        if acc_node is None or not will_run(acc_node):
            return None, False
    except RuntimeError:  # autograd.grad(): the gradient is returned, .grad stays untouched
        return None, False
    into = copies.grad_into(w) if copies is not None else None
    if into is not None:
        return into
    return (w.grad, False) if writable(w.grad, w) else (None, False)


def writable(g, w: torch.Tensor) -> bool:
    """Whether w's gradient can be added into g in place: a plain contiguous float32 or bf16 tensor
    of w's shape on w's device (the run's sink asks it too: precision.WeightCopies.grad_into)."""
    return (type(g) is torch.Tensor and g.device == w.device and g.is_contiguous() and g.shape == w.shape
            and g.dtype in (torch.float32, torch.bfloat16))


def count(w: torch.Tensor, copies=None) -> None:
    p = owner(w, copies)
    p.wgrad_adds = getattr(p, "wgrad_adds", 0) + 1  # the witness: in_place_adds


class _GroupedMM(torch.autograd.Function):
    """x and w come in as views made for this call (grouped_mm), so their nodes are never leaves:
    the engine answers whether each gradient is wanted in every kind of backward. `param` (in a
    tuple: not an autograd input) is the parameter itself, whose AccumulateGrad node tells
    .backward() (it may accumulate) from autograd.grad() (it raises there: gradients are returned),
    and the run's WeightCopies (or None)."""

    @staticmethod
    def forward(ctx, x_XD, w_EDF, offs_E, param):
        p, ctx.copies = param
        ctx.save_for_backward(x_XD, offs_E)
        ctx.w = p  # its .grad (or its master's) is written in backward
        ctx.x_node = get_gradient_edge(x_XD).node if x_XD.requires_grad else None
        ctx.nodes = grad_nodes(w_EDF, p)
        return F.grouped_mm(x_XD, w_EDF, offs=offs_E)

    @staticmethod
    def backward(ctx, dy_XF):
        x_XD, offs_E = ctx.saved_tensors
        w, (w_node, acc_node) = ctx.w, ctx.nodes
        dy_XF = dy_XF.contiguous()
        dx = dw = None
        if ctx.x_node is not None and will_run(ctx.x_node):
            dx = F.grouped_mm(dy_XF, w.transpose(-2, -1), offs=offs_E)
        if w_node is not None and will_run(w_node):
            g, fresh = target(w, acc_node, ctx.copies)
            if g is None:
                dw = F.grouped_mm(x_XD.t(), dy_XF, offs=offs_E)
            else:
                accumulate(g, x_XD, dy_XF, offs_E, add=not fresh)
                count(w, ctx.copies)
        return dx, dw, None, None


def in_place_adds(model: torch.nn.Module) -> int:
    """Weight gradients written in place so far (added, or a float32 master's first), counted on the
    parameters that own them (the bench reports it per step: the witness that the path ran, as
    fp8_linear.quantised for FP8)."""
    return sum(getattr(p, "wgrad_adds", 0) for p in model.parameters())


def grouped_mm(x_XD: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor, *, reference,
               copies=None) -> torch.Tensor:
    """`reference` (models.common.grouped_mm, bound by use_kernels with the run's `copies`) with the
    same result, whose weight gradient accumulates in place (see `target`), where the kernel applies:
    CUDA, bf16 rows, a plain bf16 parameter (bf16 parameters, or the bf16 copies inside a step) and
    autograd on; also CPU float32, for the tests of the autograd logic. Elsewhere (evaluation
    without gradients, float32 weights outside a step, widths torch's grouped GEMM cannot take) the
    reference itself: nothing accumulates there. kernels.configure turns it on only for CUDA runs
    whose steps meet these."""
    dtype_ok = x_XD.dtype == w_EDF.dtype == (torch.bfloat16 if x_XD.is_cuda else torch.float32)
    if (torch.is_grad_enabled() and dtype_ok and type(w_EDF) is torch.nn.Parameter
            and all(n % 8 == 0 for n in w_EDF.shape[1:])):
        x_XD = x_XD.contiguous()
        return _GroupedMM.apply(x_XD.view_as(x_XD), w_EDF.view_as(w_EDF), offs_E.to(torch.int32), (w_EDF, copies))
    return reference(x_XD, w_EDF, offs_E)


class _Embedding(torch.autograd.Function):
    """F.embedding whose weight gradient goes into `target`: only the rows of this micro-batch's
    tokens are touched (a new float32 master gradient is zeroed first)."""

    @staticmethod
    def forward(ctx, ids, w_VD, param):
        p, ctx.copies = param
        ctx.save_for_backward(ids)
        ctx.w, ctx.nodes = p, grad_nodes(w_VD, p)
        return F.embedding(ids, w_VD)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        w, (w_node, acc_node) = ctx.w, ctx.nodes
        if w_node is None or not will_run(w_node):
            return None, None, None
        g, fresh = target(w, acc_node, ctx.copies)
        if g is None:
            return None, torch.ops.aten.embedding_dense_backward(dy, ids, w.shape[0], -1, False), None
        if fresh:
            g.zero_()
        g.index_put_((ids.reshape(-1),), dy.reshape(-1, dy.shape[-1]).to(g.dtype), accumulate=True)
        count(w, ctx.copies)
        return None, None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor, copies=None) -> torch.Tensor:
    """F.embedding(ids, weight) whose weight gradient accumulates in place (common.Embedding.lookup,
    bound by use_kernels with the run's `copies`). Without gradients, or for a weight that is not a
    plain parameter (an FSDP shard), F.embedding itself."""
    if torch.is_grad_enabled() and weight.requires_grad and type(weight) is torch.nn.Parameter:
        return _Embedding.apply(ids, weight.view_as(weight), (weight, copies))
    return F.embedding(ids, weight)
