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

The lean training state (precision.py, `lean`): p is the master join(hi, lo), hi the bf16
parameter and lo its int16 low half, the moments bf16. The same pass (LEAN) reads hi, lo, g, m, v
and writes hi, lo, m, v: 18 B per parameter with a bf16 gradient (20 with a float32 one), where the
float32 state's pass moves 30 (28 + its bf16 copy). It updates the joined master as above and
stores it split again (`split`'s rounding, in integer arithmetic).
Off CUDA (CPU, and the reference) `lean_update_` applies torch.optim.AdamW's own single-tensor
steps to the joined master: a lean step is the float32 step of the same master, moments and
gradient, rounded into the halves and bf16 moments (tests/test_lean.py).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

try:  # Triton is optional (CPU machines): the lean state's PyTorch update runs without it
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 4096


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 -> (hi: bf16, x rounded to nearest with ties away from zero (torch's cast rounds
    ties to even: they differ at exact ties only); lo: int16, the rest of x's bits), so that
    join(hi, lo) is x, bit for bit, for every finite x. On the bits b of x: hi = (b + 2^15) >> 16
    (an arithmetic shift rounds the magnitude of a sign-magnitude number), lo = b - (hi << 16),
    within [-2^15, 2^15)."""
    bits = x.contiguous().view(torch.int32)
    hi = (bits + 0x8000) >> 16
    lo = bits - (hi << 16)
    return hi.to(torch.int16).view(torch.bfloat16), lo.to(torch.int16)


def join(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The float32 value `split` took apart (a new tensor)."""
    return ((hi.contiguous().view(torch.int16).to(torch.int32) << 16) + lo.to(torch.int32)).view(torch.float32)


def join_(x: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """In place: float32 `x` holding a high half exactly (a lean checkpoint's bf16 parameter read
    into a float32 one: its low 16 bits are zero) becomes join(hi, lo)."""
    return x.view(torch.int32).add_(lo.to(x.device, torch.int32))


def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, step_ptr, copy_ptr, N, lr, wd, beta1, beta2, log_beta1, log_beta2,
                  eps, gscale, DECAY: tl.constexpr, COPY: tl.constexpr, LEAN: tl.constexpr, BLOCK: tl.constexpr):
    """LEAN: p_ptr is the bf16 parameter read as int16 (the master's high half), copy_ptr its low half."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    if LEAN:
        hi = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32)
        p = ((hi << 16) + tl.load(copy_ptr + offs, mask=mask, other=0).to(tl.int32)).to(tl.float32, bitcast=True)
    else:
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
    if LEAN:  # split: hi = (bits + 2^15) >> 16 (arithmetic), lo = bits - (hi << 16)
        bits = p.to(tl.int32, bitcast=True)
        hi = (bits + 0x8000) >> 16
        tl.store(p_ptr + offs, hi.to(tl.int16), mask=mask)
        tl.store(copy_ptr + offs, (bits - (hi << 16)).to(tl.int16), mask=mask)
    else:
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    if COPY:  # the next step's bf16 weights (precision.WeightCopies), from the value just stored
        tl.store(copy_ptr + offs, p.to(p_ptr.dtype.element_ty).to(copy_ptr.dtype.element_ty), mask=mask)


_adamw_kernel = triton.jit(_adamw_kernel) if triton is not None else None


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x  # a DTensor's shard: AdamW is elementwise


@torch.no_grad()
def lean_update_(hi, lo, g, m, v, step: float, lr: float, wd: float, beta1: float, beta2: float, eps: float,
                 grad_scale: float = 1.0) -> None:
    """One AdamW step on the lean state in place, in PyTorch: torch.optim.AdamW's single-tensor
    arithmetic (its order of operations) on the float32 master join(hi, lo), with the gradient and
    moments read in float32; then split into hi and lo, the moments rounded to their dtype."""
    p, g = join(hi, lo), g.to(torch.float32)
    if grad_scale != 1.0:
        g = g * grad_scale
    m32, v32 = m.to(torch.float32), v.to(torch.float32)
    if wd != 0:
        p.mul_(1 - lr * wd)
    m32.lerp_(g, 1 - beta1)
    v32.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v32.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    p.addcdiv_(m32, denom, value=-(lr / (1 - beta1 ** step)))
    for dst, src in zip((hi, lo, m, v), (*split(p), m32, v32)):
        dst.copy_(src)


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
    check read them).
    `lean` (the run's precision.LeanState): the lean state, on CPU too (`lean_update_` wherever the
    kernel does not run); each parameter's gradient is lean.grad(p) (its float32 buffer over several
    micro-batches, else its bf16 .grad), its low half lean.lo(p), and zero_grad drops the buffers.
    The moments are bf16 as the parameters are (torch's zeros_like and load_state_dict)."""

    takes_grad_scale = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, copies=None, lean=None):
        # fused=True: the state dict policy of torch's fused AdamW (load_state_dict keeps `step` on
        # the parameter's device, where the kernel reads it); step() below is ours
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=lean is None,
                         foreach=False if lean is not None else None)
        self._step_supports_amp_scaling = False  # no grad_scale / found_inf: a GradScaler must not skip us
        self.copies, self.lean = copies, lean

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none)
        if self.lean is not None:
            self.lean.zero_grad()

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0):
        if closure is not None:
            raise ValueError("kernels.adamw.AdamW takes no closure")
        lean = self.lean
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or isinstance(group["lr"], torch.Tensor):
                raise ValueError("kernels.adamw.AdamW: amsgrad, maximize and tensor lr are not supported")
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, beta2 = group["betas"]
            log_beta1, log_beta2 = (math.log(b) if b > 0 else -math.inf for b in (beta1, beta2))  # 0^t = 0
            todo = [(p, g) for p in group["params"] if (g := lean.grad(p) if lean else p.grad) is not None]
            for p, _ in todo:
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif st["step"].device != p.device or st["step"].dtype != torch.float32:
                    st["step"] = st["step"].to(p.device, torch.float32)  # a non-fused checkpoint's step
            steps = [self.state[p]["step"] for p, _ in todo]
            if steps:
                torch._foreach_add_(steps, 1)
            for (p, g), step in zip(todo, steps):
                st = self.state[p]
                ts = [_local(x) for x in (p, g, st["exp_avg"], st["exp_avg_sq"])]  # AdamW is elementwise
                copy = _local(lean.lo(p)) if lean else self.copies.copy_of(p) if self.copies is not None else None
                if lean and not (ts[0].is_cuda and triton is not None and all(x.is_contiguous() for x in ts)):
                    lean_update_(ts[0], copy, *ts[1:], float(step), lr, wd, beta1, beta2, eps, grad_scale)
                elif all(x.is_contiguous() for x in ts):
                    copy = copy if (lean or copy is not None and copy.is_contiguous() and copy.shape == ts[0].shape
                                    and copy.device == p.device and copy.dtype == torch.bfloat16) else None
                    n = ts[0].numel()
                    _adamw_kernel[(triton.cdiv(n, BLOCK),)](ts[0].view(torch.int16) if lean else ts[0], *ts[1:], step,
                                                            ts[0] if copy is None else copy, n, lr, wd, beta1, beta2,
                                                            log_beta1, log_beta2, eps, grad_scale, DECAY=wd != 0,
                                                            COPY=copy is not None and not lean, LEAN=lean is not None,
                                                            BLOCK=BLOCK, num_warps=8)
                    torch.autograd.graph.increment_version(ts[0])  # Triton's stores move no version
                    if copy is not None and not lean:
                        torch.autograd.graph.increment_version(copy)
                        self.copies.written(p)
                else:
                    if grad_scale != 1.0:
                        ts[1].mul_(grad_scale)
                    torch._fused_adamw_([ts[0]], [ts[1]], [ts[2]], [ts[3]], [], [step], lr=lr,
                                        beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False,
                                        maximize=False)
        return None
