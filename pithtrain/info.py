"""Print a model's size from a recipe, without materialising it (built on the meta device).

    python -m pithtrain.info --model qwen3-30b-a3b      # or: invoke info --model qwen3-30b-a3b
"""

from __future__ import annotations

import argparse
import sys

from pithtrain.config import ConfigError, load_config
from pithtrain.metrics import flops_per_token, param_counts
from pithtrain.models import build_model


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pithtrain.info", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="embedded recipe name or recipe file (default: default)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length for the FLOPs figure")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.model)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    total, active = param_counts(build_model(cfg.model, init=False), cfg.model)  # meta tensors: shapes only
    seq = args.seq_len or cfg.train.seq_len
    print(f"{cfg.model.family} ({cfg.source}): {cfg.model.num_layers} layers, "
          f"{_count(total)} total / {_count(active)} active parameters, "
          f"{flops_per_token(cfg.model, seq) / 1e9:.2f} GFLOP per token (train, seq {seq})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
