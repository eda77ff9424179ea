"""Print a model's size from a recipe, without materialising it (built on the meta device).

    python -m pithtrain.info --model qwen3-30b-a3b      # or: invoke info --model qwen3-30b-a3b
"""

from __future__ import annotations

import argparse
import sys

from pithtrain.config import ConfigError, load_config
from pithtrain.metrics import flops_per_token, param_counts
from pithtrain.models import build_model


def describe(recipe: str, seq_len: int | None = None) -> dict:
    cfg = load_config(recipe)
    model = build_model(cfg.model, init=False)  # meta tensors: shapes only
    total, active = param_counts(model, cfg.model)
    seq = seq_len or cfg.train.seq_len
    return {"recipe": cfg.source, "family": cfg.model.family, "layers": cfg.model.num_layers,
            "total_params": total, "active_params": active, "seq_len": seq,
            "train_flops_per_token": flops_per_token(cfg.model, seq)}


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pithtrain.info", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="embedded recipe name or recipe file (default: default)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length for the FLOPs figure")
    args = p.parse_args(argv)
    try:
        d = describe(args.model, args.seq_len)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{d['family']} ({d['recipe']}): {d['layers']} layers, "
          f"{_count(d['total_params'])} total / {_count(d['active_params'])} active parameters, "
          f"{d['train_flops_per_token'] / 1e9:.2f} GFLOP per token (train, seq {d['seq_len']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
