"""LM head + cross-entropy with the gradients made during the forward pass (PyTorch, any device).

Reference: `common.cross_entropy_sum`'s checkpointed path, which computes each chunk's logits twice
(forward, then again in backward) -- 2 of the LM head's 6 FLOPs/param/token extra, a large term for
vocabularies of 150-200K. Here each chunk of `chunk` rows is done once: logits (fp32), loss, the
softmax-minus-one-hot gradient, then dh = dlogits @ W and dW += dlogits^T @ h right away. Backward
only scales the two saved gradients by the incoming scalar, which is exact because the output is
the summed loss (a scalar used linearly). Peak extra memory: one chunk of logits in fp32 and bf16
plus dW. Under autocast the matmuls run in the autocast dtype, as the reference's would.
On CUDA with Triton the loss and the logit gradient come from kernels/ce.py (two streaming passes
over the bf16 logits, gradient written in place); elsewhere from the PyTorch code below.
`in_place` (kernels.configure's `wgrad`): backward adds the scaled dW into the gradient it
accumulates into (kernels/wgrad.target: p.grad, or a float32 master's) in one pass, instead of
returning it for autograd to add.
"""

from __future__ import annotations

import torch

from pithtrain.kernels import wgrad

try:
    from pithtrain.kernels.ce import ce_rows_inplace

    _HAVE_TRITON = True
except ImportError:  # no Triton: the PyTorch path below
    _HAVE_TRITON = False


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, weight_VD, labels_T, chunk: int, param: tuple):
        dt = torch.get_autocast_dtype(h_TD.device.type) if torch.is_autocast_enabled(h_TD.device.type) \
            else h_TD.dtype
        with torch.autocast(h_TD.device.type, enabled=False):
            h, w = h_TD.to(dt), weight_VD.to(dt)
            T = h.shape[0]
            dh = torch.empty_like(h)
            dw = None  # made by the first chunk's product (no zero-filled buffer to read back)
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            triton_ce = h.is_cuda and _HAVE_TRITON
            for s in range(0, T, chunk):
                hc, lc = h[s:s + chunk], labels_T[s:s + chunk]
                if triton_ce:  # loss and softmax - onehot in two streaming passes, in place
                    g = hc @ w.t()  # (c, V) in the compute dtype
                    total += ce_rows_inplace(g, lc).sum()
                else:
                    g, loss = _ce_grad_torch(hc @ w.t(), lc)
                    total += loss
                    g = g.to(dt)
                dh[s:s + chunk] = g @ w
                if dw is None:
                    dw = (g.t() @ hc).to(weight_VD.dtype)
                elif dw.dtype == dt:
                    dw.addmm_(g.t(), hc)
                else:
                    dw += (g.t() @ hc).to(dw.dtype)
                del g
        if dw is None:  # no rows
            dw = torch.zeros_like(weight_VD)
        ctx.save_for_backward(dh, dw)
        ctx.h_dtype = h_TD.dtype
        ctx.w, ctx.copies = param if param else (None, None)  # in place: the parameter, the run's copies
        ctx.nodes = wgrad.grad_nodes(weight_VD, ctx.w) if param else None  # and its nodes (kernels/wgrad.py)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        dh, dw = ctx.saved_tensors
        dh = (dh * grad_out.to(dh.dtype)).to(ctx.h_dtype)
        if ctx.w is not None:  # in place
            if ctx.nodes[0] is None or not wgrad.will_run(ctx.nodes[0]):  # e.g. the pipeline's input-only pass
                return dh, None, None, None, None
            g, fresh = wgrad.target(ctx.w, ctx.nodes[1], ctx.copies)
            if g is not None:  # float32 arithmetic either way (an expanded scale takes part in promotion)
                if fresh:
                    torch.mul(dw, grad_out.expand_as(dw), out=g)
                else:
                    g.addcmul_(dw, grad_out)
                wgrad.count(ctx.w, ctx.copies)
                return dh, None, None, None, None
        return dh, dw * grad_out.to(dw.dtype), None, None, None


def _ce_grad_torch(logits, labels):
    """(softmax - onehot on valid rows, fp32; summed loss) -- the PyTorch path (CPU, no Triton)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    valid = labels != -100
    tgt = labels.clamp(min=0)
    picked = logits.gather(1, tgt[:, None]).squeeze(1)
    loss = torch.where(valid, lse - picked, 0.0).sum()
    probs = logits.sub_(lse[:, None]).exp_()
    probs.scatter_add_(1, tgt[:, None], torch.full_like(picked, -1.0)[:, None])
    return probs.mul_(valid[:, None]), loss


def linear_cross_entropy_sum(h_TD, weight_VD, labels_T, chunk: int = 4096, in_place: bool = False, copies=None):
    """Sum of token cross-entropies of (h @ W^T) against labels (-100 ignored). in_place: W's
    gradient accumulates in place (module docstring), where W is a plain parameter (`copies`: the
    run's precision.WeightCopies, kernels/wgrad.target)."""
    if in_place and weight_VD.requires_grad and type(weight_VD) is torch.nn.Parameter:
        return _LinearCrossEntropy.apply(h_TD, weight_VD.view_as(weight_VD), labels_T, chunk, (weight_VD, copies))
    return _LinearCrossEntropy.apply(h_TD, weight_VD, labels_T, chunk, ())
