"""Fused operators for the hot path, each with a plain-PyTorch reference it is tested against.

  operator                    fused version                                  reference (always available)
  SwiGLU / GPT-OSS clamped    `swiglu.py` (Triton, fwd + bwd)                `models.common.swiglu`
  token permute / unpermute   `permute.py` (Triton gathers, no atomics)      `LocalDispatcher` index / index_add
  per-expert bias (GPT-OSS)   `expert_bias.py` (Triton add, segment-sum      `h + b[expert_X]`
                              backward)
  LM head + cross-entropy     `linear_ce.py` (grads made in forward;         `common.cross_entropy_sum` checkpointed
                              `ce.py` Triton rows)
  attention with sinks /      `flex.py` (FlexAttention, block-sparse)        `common.eager_attention`
    sliding window / documents
  plain causal attention      cuDNN-first SDPA (`common.attention`'s         SDPA's own choice
                              `sdpa_first`)
  causal attention incl.      `fa4.py` (flash-attn-4 where installed,        the two rows above
    window + sinks and        Hopper+)
    documents (varlen), bf16 / fp16
  blockwise FP8 expert GEMMs  `deepgemm.py` (DeepGEMM's FP8 grouped GEMMs,   `fp8_linear.py` (autograd, weight cache,
    (`train.fp8`)             Hopper, where installed); else `fp8.py`        dequantise + fp32 matmul);
                              (Triton quantisation + scaled grouped GEMMs)   `deepgemm.REFERENCE`
  AdamW (the optimizer step)  `adamw.py` (one Triton pass per parameter)     `torch.optim.AdamW(fused=True)`
  weight gradients over       `wgrad.py` (added in place: `wgrad_triton.py`'s autograd's gradient + `add_`
    micro-batches (experts:   k-grouped GEMM, the embedding's rows, the
    `wgrad`; embedding, LM    head's scaled dW)
    head: `wgrad_ends`)

The policy is here, the choice lives in the model. `configure(mode, device, fp8=, bf16=, fsdp=,
experts_alone=, cp=)` returns which operators a run uses (name -> on) from the recipe's
`train.kernels` ("auto": every fused operator whose requirements are met; "torch": none), what is
installed, and the run's facts (its precision and layout: build.build_run passes them, none has a
default); `describe(use, common.attention_kernels(model, use))` is the line the trainer and the
bench print at start-up, each layer's attention kernel included.
`models.common.use_kernels(model, use, copies)` then resolves the choice into the model's own
swappable attributes (the idiom `parallelize` uses for the dispatcher), so two models in one
process each run their own kernels and nothing global is read:

  GroupedExperts.mm       the grouped expert GEMM, (x_XD, w parameter, offs_E) -> y: common.grouped_mm,
                          wgrad.grouped_mm (its weight gradient accumulates in place), or a
                          deepgemm.FP8GroupedMM / fp8_linear.FP8GroupedMM (one per experts module:
                          it owns the weight cache)
  GroupedExperts.swiglu, .bias_add   the activation and the per-expert bias add
  Embedding.lookup        the token embedding: F.embedding, or wgrad.embedding (its gradient in place)
  LocalDispatcher.fused   the Triton permute / unpermute
  <attention>.attention   functools.partial(common.attention, sdpa_first=, flex=, fa4=) for every attention
                          module (context parallel then replaces it); fa4 per layer, only where the
                          shapes flash-attn-4 is tested at cover the layer's `attention_shapes`
                          (fa4.TESTED, fa4.covers); flex: one flex.FlexAttention per model, also held
                          by `model.rotary` to build the batch's block masks eagerly; `model.rotary
                          .fa4` / `.fa4_all`: the rotary makes flash-attn-4's document starts where
                          some layer runs it, and the block masks unless every layer does and
                          half-precision autocast lets it take them
  model.cross_entropy     the chunked LM-head loss (common.cross_entropy_sum or linear_ce's; with
                          wgrad, linear_ce adds the head's gradient in place)

and `build.build_optimizer(..., use)` picks the AdamW class (adamw.AdamW or torch's).

A new backend (DeepGEMM for the expert GEMM, another attention kernel) is one more name in `NAMES`,
its requirement in `configure`, and one more branch in `use_kernels` assigning a callable of the
same signature; the model files do not change.
"""

from __future__ import annotations

import torch

try:  # Triton is optional (CPU machines, CI); every Triton operator has a PyTorch fallback.
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

# The blockwise FP8 format both FP8 implementations share (fp8.py in Triton, fp8_linear.py in PyTorch).
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128  # scale block: 1 x BLOCK for activations, BLOCK x BLOCK for weights

NAMES = ("swiglu", "permute", "expert_bias", "linear_ce", "flex", "cudnn_sdpa", "fa4", "fp8", "deepgemm", "adamw",
         "wgrad", "wgrad_ends")


def configure(mode: str, device: torch.device | str, *, fp8: bool, bf16: bool, fsdp: bool, experts_alone: bool,
              cp: bool, off: tuple = ()) -> dict:
    """The operators a run uses (name -> on): mode "auto" (fastest available) or "torch"
    (references); `off` names operators to keep on their reference (the bench's `no-NAME`). The
    run's facts have no defaults: a caller that forgets one must not turn a path on (in-place weight
    gradients under FSDP, say). `bf16`: the run computes in bf16 (precision.Precision.compute);
    `fsdp`, `experts_alone`, `cp`: its layout (ParallelDims.fsdp_enabled, .experts_alone, .cp_enabled).
    `fp8` (train.fp8) routes the routed experts' GEMMs through FP8; the trainer has already refused
    it where it cannot run (build.check_run). They run on DeepGEMM (`deepgemm`: deep_gemm
    loadable, a Hopper GPU; Blackwell's path is coded but untested, so off there) or else on
    fp8_linear's Triton kernels. `wgrad` (the experts' in-place weight gradient) needs bf16 compute
    (`bf16`), a Hopper or later GPU (its kernel loads through TMA) and a gradient that outlives the
    micro-batch: not under FSDP (`fsdp`), which reduces and frees it after each one, unless FSDP
    leaves the experts out (`experts_alone`: parallel_dims.experts_alone), nor with the Triton FP8
    experts (their own weight gradient); DeepGEMM's FP8 experts take it. `wgrad_ends` (the
    embedding's and LM head's) rides on it, and never under FSDP, which owns their gradients.
    `fa4` needs flash-attn-4 installed, a Hopper or later GPU and bf16 compute (its kernels'
    dtypes; float32 runs take SDPA / FlexAttention, and the rotary then makes no document starts).
    Under context parallel (`cp`) its own attention replaces the model's, so the attention kernels
    (flex, cudnn_sdpa, fa4) are off there rather than listed as running."""
    from pithtrain.kernels.fa4 import HAVE_FA4

    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    auto = mode == "auto"
    triton_ok = auto and cuda and HAVE_TRITON
    hopper = cuda and torch.cuda.get_device_capability(device)[0] >= 9
    attn = auto and cuda and not cp
    sm90 = cuda and torch.cuda.get_device_capability(device)[0] == 9
    use = dict(swiglu=triton_ok, permute=triton_ok, expert_bias=triton_ok, linear_ce=auto, flex=attn,
               cudnn_sdpa=attn and torch.backends.cudnn.is_available(), fa4=attn and hopper and HAVE_FA4 and bf16,
               fp8=fp8, deepgemm=fp8 and triton_ok and sm90 and "deepgemm" not in off and _deepgemm(),
               adamw=triton_ok, wgrad=triton_ok and bf16 and (not fsdp or experts_alone) and hopper,
               wgrad_ends=not fsdp)
    use = {k: v and k not in off for k, v in use.items()}
    use["deepgemm"] = use["deepgemm"] and use["fp8"]  # (the bench's no-fp8)
    use["wgrad"] = use["wgrad"] and (not use["fp8"] or use["deepgemm"])
    use["wgrad_ends"] = use["wgrad_ends"] and use["wgrad"]
    return use


def _deepgemm() -> bool:
    from pithtrain.kernels.deepgemm import load
    return load() is not None


def describe(use: dict, attention: dict[int, str]) -> str:
    """The start-up line: the fused operators, the references, and each layer's attention kernel
    (`attention`: layer -> kernel, as models.common.attention_kernels reads them from the model)."""
    why = "" if HAVE_TRITON else " (triton not installed)"
    on = [k for k, v in use.items() if v]
    off = [k for k, v in use.items() if not v]
    groups: dict[str, list[int]] = {}
    for i, name in attention.items():
        groups.setdefault(name, []).append(i)
    attn = "; ".join(f"{'layer' if len(ix) == 1 else 'layers'} {_spans(ix)} {name}" for name, ix in groups.items())
    return (f"kernels: fused {', '.join(on) or 'none'}; PyTorch reference for "
            f"{', '.join(off) or 'none'}{why}; attention: {attn or 'none'}")


def _spans(ix: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for i in ix:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
