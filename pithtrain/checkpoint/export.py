"""Export a training checkpoint to Hugging Face safetensors (config.json + model*.safetensors).

    python -m pithtrain.checkpoint.export --ckpt runs/default --out hf/        # newest valid checkpoint
    python -m pithtrain.checkpoint.export --ckpt runs/default/checkpoints/step_300 --out hf/ --dtype bfloat16

--ckpt takes a step_N directory, a run's checkpoints/ directory or a run directory. The checkpoint is
verified against its manifest, the model is rebuilt from the recipe saved with it, its weights are
loaded in one process whatever layout saved them (DCP reshards), and `save_hf` writes the hub layout
that transformers.AutoModelForCausalLM.from_pretrained reads.
"""

from __future__ import annotations

import argparse
import sys

import torch
import yaml

from pithtrain.checkpoint.dcp import RECIPE, CheckpointError, load_model_weights, resolve
from pithtrain.checkpoint.hf import save_hf
from pithtrain.config import ConfigError, config_from_dict
from pithtrain.models import build_model


def load_checkpoint_model(ckpt) -> torch.nn.Module:
    """The model of a verified training checkpoint, on CPU in float32 (the master weights)."""
    path = resolve(ckpt)
    saved = yaml.safe_load((path / RECIPE).read_text())
    # Only the model section matters here; the others name paths of the training machine (data
    # shards, init_from) that need not exist where the export runs, so no cross-checks with them.
    cfg = config_from_dict({"model": saved["model"]}, source=str(path / RECIPE), cross_checks=False)
    model = build_model(cfg.model, "cpu")
    load_model_weights(path, model)
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pithtrain.checkpoint.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="step_N dir, checkpoints dir or run dir")
    p.add_argument("--out", required=True, help="output directory (Hugging Face layout)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args(argv)
    try:
        model = load_checkpoint_model(args.ckpt)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    save_hf(model, args.out, dtype=getattr(torch, args.dtype))
    print(f"export: wrote {args.out} ({args.dtype})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
