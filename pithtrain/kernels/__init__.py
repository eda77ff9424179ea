"""Fused operators for the hot path, each with a plain-PyTorch reference it is tested against.

| operator | fused version | reference (always available) |
| --- | --- | --- |
| SwiGLU / GPT-OSS clamped SwiGLU | `swiglu.py` (Triton, fwd + bwd) | `models.common.swiglu` |
| token permute / weighted unpermute | `permute.py` (Triton gathers, no atomics) | `LocalDispatcher` index/index_add |
| per-expert bias (GPT-OSS) | `expert_bias.py` (Triton add, segment-sum backward) | `h + b[expert_X]` |
| LM head + cross-entropy | `linear_ce.py` (grads made in forward; `ce.py` Triton rows) | `common.cross_entropy_sum` checkpointed |
| attention with sinks / sliding window | `flex.py` (FlexAttention, block-sparse) | `common.eager_attention` |
| plain causal attention | cuDNN / flash SDPA, chosen in `common.attention` | SDPA's own choice |
| blockwise FP8 expert GEMMs (`train.fp8`) | `fp8.py` (Triton quantisation + scaled grouped GEMMs) | `pithtrain.fp8` (dequantise + fp32 matmul) |

The choice is explicit and global for the process: `configure(mode, device)` sets `USE` from the
recipe's `train.kernels` ("auto": every fused operator whose requirements are met; "torch": none)
and what is installed, and `describe()` is the line the trainer and the bench print at start-up.
Model code asks `USE[name]` at call time and only for CUDA tensors; nothing is registered.
"""

from __future__ import annotations

import torch

try:  # Triton is optional (CPU machines, CI); every Triton operator has a PyTorch fallback.
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

try:
    from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

    HAVE_FLEX = True
except ImportError:
    HAVE_FLEX = False

# What the hot path uses now. Everything off until `configure` runs (CPU tests, imports).
USE = {"swiglu": False, "permute": False, "expert_bias": False, "linear_ce": False, "flex": False,
       "cudnn_sdpa": False, "fp8": False}


def configure(mode: str = "auto", device: torch.device | str = "cuda", fp8: bool = False) -> dict:
    """Pick the operators for this process: mode "auto" (fastest available) or "torch" (references).
    `fp8` (train.fp8) routes the routed experts' GEMMs through pithtrain.fp8; the trainer has
    already refused it where it cannot run (train.check_runnable)."""
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    auto = mode == "auto"
    triton_ok = auto and cuda and HAVE_TRITON
    USE.update(swiglu=triton_ok, permute=triton_ok, expert_bias=triton_ok, linear_ce=auto, flex=auto and cuda and HAVE_FLEX,
               cudnn_sdpa=auto and cuda and torch.backends.cudnn.is_available(), fp8=fp8)
    return dict(USE)


def describe() -> str:
    why = "" if HAVE_TRITON else " (triton not installed)"
    on = [k for k, v in USE.items() if v]
    off = [k for k, v in USE.items() if not v]
    return (f"kernels: fused {', '.join(on) or 'none'}; PyTorch reference for "
            f"{', '.join(off) or 'none'}{why}")
