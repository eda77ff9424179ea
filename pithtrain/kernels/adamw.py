"""AdamW as one Triton pass per parameter tensor.

torch's fused AdamW (`torch.optim.AdamW(fused=True)`, multi-tensor chunks) moves 14 B per bf16
parameter (28 B in float32) at ~2.2 TB/s on the H200: 52 ms of a 12-layer Qwen3 step, a quarter
of the step at one micro-batch (docs/perf-notes.md). This is the same update in the order torch's
fused kernel applies it (float32 arithmetic, results stored in each tensor's dtype), one kernel
launch per parameter streaming p, g, m, v once:

    p  <- p - lr * wd * p                                   (when wd != 0)
    g  <- grad_scale * g                                    (the clip's factor, train_step)
    m  <- beta1 * m + (1 - beta1) * g
    v  <- beta2 * v + (1 - beta2) * g * g
    p  <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

The step count t stays a float32 scalar on the parameter's device, as fused=True keeps it, and the
kernel reads it there: no host synchronisation, and the state dict is torch's (checkpoints move
between the two). The bias corrections are computed from t in float32 in the kernel, as torch's
capturable AdamW does (its fused kernel uses double): in the first steps at beta2 = 0.999 the update
differs by ~1e-5 relative. Reference: torch.optim.AdamW (tests/test_kernels_gpu.py).

LeanAdamW is the same update on the lean training state (precision.py): the master is the bf16
parameter (its high half) joined with its int16 low half, the moments are bf16. One pass reads
hi, lo, g, m, v (10 B per parameter with a bf16 gradient, where the float32 state's pass reads
28), computes the update above in float32 on the joined master, and stores it split again
(`_lean_kernel`; precision.split's rounding in integer arithmetic). Its PyTorch update
(`lean_update_`, CPU and the reference) applies torch.optim.AdamW's own single-tensor steps to the
joined master, so on CPU a lean step is the float32 step of the same master, moments and
gradient, rounded into the halves and bf16 moments (tests/test_lean.py).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from pithtrain.precision import join, split

try:  # Triton is optional (CPU machines): LeanAdamW's PyTorch update runs without it
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 4096


def _jit(fn):
    return triton.jit(fn) if triton is not None else None


@_jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, step_ptr, copy_ptr, N, lr, wd, beta1, beta2, log_beta1, log_beta2,
                  eps, gscale, DECAY: tl.constexpr, COPY: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * gscale
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t = tl.load(step_ptr)
    bc1 = 1.0 - tl.exp(t * log_beta1)
    bc2_sqrt = tl.sqrt(1.0 - tl.exp(t * log_beta2))
    if DECAY:  # as torch: no decay term at all when wd == 0 (an inf weight stays inf, not nan)
        p = p - lr * wd * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    if COPY:  # the next step's bf16 weights (precision.WeightCopies), from the value just stored
        tl.store(copy_ptr + offs, p.to(p_ptr.dtype.element_ty).to(copy_ptr.dtype.element_ty), mask=mask)


@_jit
def _lean_kernel(hi_ptr, lo_ptr, g_ptr, m_ptr, v_ptr, step_ptr, N, lr, wd, beta1, beta2, log_beta1, log_beta2, eps,
                 gscale, DECAY: tl.constexpr, BLOCK: tl.constexpr):
    """_adamw_kernel's update on the master join(hi, lo) (hi_ptr: the bf16 parameter as int16),
    stored split again: hi = (bits + 2^15) >> 16 (arithmetic), lo = bits - (hi << 16)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    hi = tl.load(hi_ptr + offs, mask=mask, other=0).to(tl.int32)
    lo = tl.load(lo_ptr + offs, mask=mask, other=0).to(tl.int32)
    p = ((hi << 16) + lo).to(tl.float32, bitcast=True)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * gscale
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t = tl.load(step_ptr)
    bc1 = 1.0 - tl.exp(t * log_beta1)
    bc2_sqrt = tl.sqrt(1.0 - tl.exp(t * log_beta2))
    if DECAY:
        p = p - lr * wd * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
    bits = p.to(tl.int32, bitcast=True)
    hi = (bits + 0x8000) >> 16
    lo = bits - (hi << 16)
    tl.store(hi_ptr + offs, hi.to(tl.int16), mask=mask)
    tl.store(lo_ptr + offs, lo.to(tl.int16), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


def _log(beta: float) -> float:
    return math.log(beta) if beta > 0 else -math.inf  # beta^t = exp(t log beta); 0^t = 0


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW (same arguments, state and state dict) whose step runs `_adamw_kernel` on
    each CUDA parameter; a tensor the kernel cannot stream (not contiguous) takes torch's fused
    kernel instead. No amsgrad, maximize, tensor learning rates or closures: refused here.
    step(grad_scale=c) updates with c * g, the gradient clip's multiply folded into the same pass
    (train_step): the gradients are not rewritten (4 B per bf16 parameter less), except a
    non-contiguous one, multiplied before torch's kernel takes it. A float32 master with a bf16 copy
    (`copies`: the run's precision.WeightCopies) gets the copy rewritten in the same pass (2 B per
    parameter, where the next step's cast would read 4 and write 2), marked current there. Both
    tensors' versions move on, as a torch op's would (FP8 weight caches and autograd's saved-tensor
    check read them)."""

    takes_grad_scale = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, copies=None):
        # fused=True: the state dict policy of torch's fused AdamW (load_state_dict keeps `step` on
        # the parameter's device, where the kernel reads it); step() below is ours
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        self._step_supports_amp_scaling = False  # no grad_scale / found_inf: a GradScaler must not skip us
        self.copies = copies

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0):
        if closure is not None:
            raise ValueError("kernels.adamw.AdamW takes no closure")
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or isinstance(group["lr"], torch.Tensor):
                raise ValueError("kernels.adamw.AdamW: amsgrad, maximize and tensor lr are not supported")
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, beta2 = group["betas"]
            log_beta1, log_beta2 = _log(beta1), _log(beta2)
            todo = [p for p in group["params"] if p.grad is not None]
            for p in todo:
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif st["step"].device != p.device or st["step"].dtype != torch.float32:
                    st["step"] = st["step"].to(p.device, torch.float32)  # a non-fused checkpoint's step
            steps = [self.state[p]["step"] for p in todo]
            if steps:
                torch._foreach_add_(steps, 1)
            for p, step in zip(todo, steps):
                st = self.state[p]
                ts = [x.to_local() if isinstance(x, DTensor) else x  # a DTensor's shard: AdamW is elementwise
                      for x in (p, p.grad, st["exp_avg"], st["exp_avg_sq"])]
                if all(x.is_contiguous() for x in ts):
                    n = ts[0].numel()
                    copy = self.copies.copy_of(p) if self.copies is not None else None
                    copy = copy if (copy is not None and copy.is_contiguous() and copy.shape == ts[0].shape
                                    and copy.device == p.device and copy.dtype == torch.bfloat16) else None
                    _adamw_kernel[(triton.cdiv(n, BLOCK),)](*ts, step, ts[0] if copy is None else copy, n, lr, wd,
                                                            beta1, beta2, log_beta1, log_beta2, eps, grad_scale,
                                                            DECAY=wd != 0, COPY=copy is not None, BLOCK=BLOCK,
                                                            num_warps=8)
                    torch.autograd.graph.increment_version(ts[0])  # Triton's stores move no version
                    if copy is not None:
                        torch.autograd.graph.increment_version(copy)
                        self.copies.written(p)
                else:
                    if grad_scale != 1.0:
                        ts[1].mul_(grad_scale)
                    torch._fused_adamw_([ts[0]], [ts[1]], [ts[2]], [ts[3]], [], [step], lr=lr,
                                        beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False,
                                        maximize=False)
        return None


# ---------------------------------------------------------------------------------------------
# The lean state


@torch.no_grad()
def lean_update_(hi, lo, g, m, v, step: float, lr: float, wd: float, beta1: float, beta2: float, eps: float,
                 grad_scale: float = 1.0) -> None:
    """One AdamW step on the lean state in place, in PyTorch: torch.optim.AdamW's single-tensor
    arithmetic (its order of operations) on the float32 master join(hi, lo), moments and gradient
    read in float32, then split into hi, lo and the moments rounded to their dtype."""
    p, g = join(hi, lo), g.to(torch.float32)
    if grad_scale != 1.0:
        g = g * grad_scale
    m32, v32 = m.to(torch.float32), v.to(torch.float32)
    if wd != 0:
        p.mul_(1 - lr * wd)
    m32.lerp_(g, 1 - beta1)
    v32.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    denom = (v32.sqrt() / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(m32, denom, value=-(lr / (1 - beta1 ** step)))
    new_hi, new_lo = split(p)
    hi.copy_(new_hi)
    lo.copy_(new_lo)
    m.copy_(m32)
    v.copy_(v32)


class LeanAdamW(torch.optim.AdamW):
    """AdamW on the lean state (precision.LeanState `lean`): the state dict is torch's (step,
    exp_avg, exp_avg_sq; the moments bf16, as the parameter is), the masters' low halves stay in
    `lean` (checkpoint/dcp.py saves them beside). Each parameter's gradient is lean.grad(p): its
    float32 buffer over several micro-batches, else its bf16 .grad; zero_grad drops the buffers.
    step(grad_scale=c): the clip's factor folded in, as AdamW's. A CUDA tensor takes `_lean_kernel`
    (Triton), anything else `lean_update_`. No amsgrad, maximize, tensor lr or closures."""

    takes_grad_scale = True

    def __init__(self, params, lean, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        self._step_supports_amp_scaling = False
        self.lean = lean

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none)
        self.lean.zero_grad()

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0):
        if closure is not None:
            raise ValueError("kernels.adamw.LeanAdamW takes no closure")
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or isinstance(group["lr"], torch.Tensor):
                raise ValueError("kernels.adamw.LeanAdamW: amsgrad, maximize and tensor lr are not supported")
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, beta2 = group["betas"]
            todo = [(p, g) for p in group["params"] if (g := self.lean.grad(p)) is not None]
            for p, _ in todo:
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif st["step"].device != p.device or st["step"].dtype != torch.float32:
                    st["step"] = st["step"].to(p.device, torch.float32)
            steps = [self.state[p]["step"] for p, _ in todo]
            if steps:
                torch._foreach_add_(steps, 1)
            for (p, g), step in zip(todo, steps):
                st = self.state[p]
                ts = [x.to_local() if isinstance(x, DTensor) else x
                      for x in (p, self.lean.lo(p), g, st["exp_avg"], st["exp_avg_sq"])]
                if ts[0].is_cuda and triton is not None and all(x.is_contiguous() for x in ts):
                    n = ts[0].numel()
                    _lean_kernel[(triton.cdiv(n, BLOCK),)](ts[0].view(torch.int16), *ts[1:], step, n, lr, wd, beta1,
                                                           beta2, _log(beta1), _log(beta2), eps, grad_scale,
                                                           DECAY=wd != 0, BLOCK=BLOCK, num_warps=8)
                    torch.autograd.graph.increment_version(ts[0])  # Triton's stores move no version
                else:
                    lean_update_(*ts, float(step), lr, wd, beta1, beta2, eps, grad_scale)
        return None
