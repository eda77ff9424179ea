"""Host cost of the calls a host-bound step makes most (scripts/step_probe.py finds them), on one
GPU: attention forward + backward through flash-attn-4 (kernels/fa4.py) and cuDNN SDPA at each
family's attention shape (batch 2 x 4096, bf16), torch.mm at DeepSeek-V2-Lite's dense shapes (8192
tokens) under each cuBLAS front end torch offers, and a Python profile of flash-attn-4's call.

    python scripts/launch_probe.py [--iters 20]

Host microseconds per call: the launch loop timed before it synchronises (the queue never fills at
these sizes); GPU microseconds per call from CUDA events."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from pithtrain.models.common import SDPA_CUDNN_FIRST, attention

ATTENTION = {  # name: (query heads, key/value heads, d_qk, d_v, window, sinks)
    "qwen3": (32, 4, 128, 128, None, False),
    "deepseek": (16, 16, 192, 128, None, False),
    "gpt-oss full": (64, 8, 64, 64, None, True),
    "gpt-oss window": (64, 8, 64, 64, 128, True),
}
MM = [(8192, 2048, 3072), (8192, 2048, 576), (8192, 512, 4096), (8192, 2048, 2048), (2048, 8192, 3072)]


def timed(fn, iters: int) -> tuple[float, float]:
    """(host microseconds to issue one call, GPU microseconds per call)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    host = (time.perf_counter() - t0) / iters * 1e6
    b.synchronize()
    return host, a.elapsed_time(b) / iters * 1e3


def attention_calls(B=2, S=4096):
    """{shape: {path: fwd + bwd call}}: flash-attn-4 where installed, cuDNN for the plain shapes."""
    from pithtrain.kernels.fa4 import HAVE_FA4

    calls = {}
    for name, (H, K, d, e, window, sinks) in ATTENTION.items():
        q = torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, K, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, K, S, e, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        s = torch.randn(H, device="cuda", dtype=torch.bfloat16, requires_grad=True) if sinks else None
        go = torch.randn(B, H, S, e, device="cuda", dtype=torch.bfloat16)
        kw = dict(scale=d ** -0.5, window=window, sinks_H=s)
        paths = {}
        if HAVE_FA4:
            paths["fa4"] = lambda q=q, k=k, v=v, go=go, kw=kw: attention(q, k, v, fa4=True, **kw).backward(go)
        if window is None and not sinks:
            paths["cudnn"] = lambda q=q, k=k, v=v, go=go, kw=kw: attention(
                q, k, v, sdpa_first=SDPA_CUDNN_FIRST, **kw).backward(go)
        calls[name] = paths
    return calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    print(f"{'attention fwd + bwd':20s} {'path':6s} {'host us':>8s} {'gpu us':>8s}")
    calls = attention_calls()
    for name, paths in calls.items():
        for path, fn in paths.items():
            host, gpu = timed(fn, args.iters)
            print(f"{name:20s} {path:6s} {host:8.0f} {gpu:8.0f}", flush=True)
    libs = ["cublas", "cublaslt"]
    print(f"{'mm m x k x n':20s} " + " ".join(f"{lib + ' host / gpu us':>26s}" for lib in libs))
    default = torch.backends.cuda.preferred_blas_library()
    for m, k, n in MM:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        row = []
        for lib in libs:
            torch.backends.cuda.preferred_blas_library(lib)
            row.append("%10.1f / %9.1f" % timed(lambda: torch.mm(a, b), 50))
        print(f"{f'{m}x{k}x{n}':20s} " + " ".join(f"{r:>26s}" for r in row), flush=True)
    torch.backends.cuda.preferred_blas_library(default)
    fa4 = calls["deepseek"].get("fa4")
    if fa4 is not None:  # where flash-attn-4's host time goes
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.iters):
            fa4()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue())


if __name__ == "__main__":
    main()
