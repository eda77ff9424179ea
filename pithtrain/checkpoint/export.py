"""Export a training checkpoint to Hugging Face safetensors (config.json + model*.safetensors).

    python -m pithtrain.checkpoint.export --ckpt runs/default --out hf/         # newest valid, bf16
    python -m pithtrain.checkpoint.export --ckpt runs/default/checkpoints/step_300 --out hf/ --dtype float32
    torchrun --nproc-per-node 8 -m pithtrain.checkpoint.export --ckpt runs/qwen3-30b --out hf/

--ckpt takes a step_N directory, a run's checkpoints/ directory or a run directory. The checkpoint is
verified against its manifest (under torchrun every rank hashes a share), the model is built from
the recipe saved with it on the meta device (no memory, no random init), and the weights stream
tensor by tensor: each native tensor is read alone from the sharded checkpoint (DCP reads the
chunks of it whatever layout saved them), converted to the hub layout and dtype, and written into
its output shard file as it comes (the header first: the shard plan is made from the shapes, so
every rank knows every file name and the index before any read). Host memory: one float32
tensor (read) and its converted copy, whatever the shard size. Under torchrun rank r writes
shards r, r + world, ...
The tokenizer files come from the checkpoint (it carries the shards' tokenizer.json); a run on the
stdlib bytes has none and says so; a shards checkpoint without one is an error. config.json and
generation_config.json carry the BOS / EOS / pad ids (`special_token_ids`), so generate stops at EOS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from pithtrain.checkpoint.dcp import (
    RECIPE,
    TRAINER,
    CheckpointError,
    agree,
    check_index,
    lean_checkpoint,
    read_tensors,
    resolve,
    verify,
)
from pithtrain.checkpoint.hf import SHARD_BYTES, refuse_hub_losses, state_for_export, write_hub
from pithtrain.config import ConfigError, config_from_dict
from pithtrain.data import BOS, EOS, TOKENIZER_FILES, added_around, declared_tokens, load_tokenizer
from pithtrain.kernels.adamw import join_
from pithtrain.models import build_model


def checkpoint_recipe(path: Path):
    """The run's config from the recipe saved with a checkpoint. Only the model section is
    checked: the others name paths of the training machine (data shards, init_from) that need
    not exist where the export runs."""
    saved = yaml.safe_load((path / RECIPE).read_text())
    return config_from_dict({"model": saved["model"]}, source=str(path / RECIPE), cross_checks=False), saved


def load_checkpoint_model(ckpt) -> torch.nn.Module:
    """The model of a verified training checkpoint, on CPU in float32 (the master weights),
    whole in memory: for evaluation and tests; export streams instead."""
    from pithtrain.checkpoint.dcp import load_model_weights
    path = resolve(ckpt)
    model = build_model(checkpoint_recipe(path)[0].model, "cpu")  # initialised: RoPE's table is no checkpoint tensor
    load_model_weights(path, model)
    return model.eval()


def checkpoint_tokenizer(ckpt: Path, saved_recipe: dict) -> Path | None:
    """The tokenizer.json a checkpoint carries, or None for a run on the stdlib bytes (which no
    tokenizer describes); a shards checkpoint without one is an error."""
    data = saved_recipe.get("data") or {}
    if (ckpt / "tokenizer.json").is_file() or data.get("source", "stdlib") == "stdlib":
        return ckpt / "tokenizer.json" if (ckpt / "tokenizer.json").is_file() else None
    raise CheckpointError(f"{ckpt / 'tokenizer.json'}: missing (saved before checkpoints carried the run's "
                          f"tokenizer): copy the one beside the run's shards ({data.get('path')}) there")


def copy_tokenizer(ckpt: Path, saved_recipe: dict, out: Path) -> str:
    """Copy the checkpoint's tokenizer files into the export; returns what was done."""
    if checkpoint_tokenizer(ckpt, saved_recipe) is None:
        return "no tokenizer: the run trained on stdlib bytes (ids 0-255 bytes, 256 BOS, 257 EOS)"
    copied = [f for f in TOKENIZER_FILES if (ckpt / f).is_file()]
    for f in copied:
        shutil.copyfile(ckpt / f, out / f)
    if "tokenizer_config.json" not in copied:  # else transformers picks the family's tokenizer class,
        # which rebuilds the tokenizer from its vocabulary with its own pre-tokenizer: other ids
        eos = (json.loads((ckpt / TRAINER).read_text()).get("data") or {}).get("eos")
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", **({"eos_token": eos} if eos else {})}, indent=1))
    made = "" if "tokenizer_config.json" in copied else "; wrote tokenizer_config.json"
    return f"tokenizer from {ckpt} ({', '.join(copied)}{made})"


def special_token_ids(ckpt: Path, saved_recipe: dict) -> dict:
    """bos_token_id / eos_token_id / pad_token_id of the run's ids, for config.json and
    generation_config.json (so that generate stops at the end of a text): the stdlib bytes' BOS 256
    and EOS 257, or from the checkpoint's tokenizer: EOS the one its documents ended with
    (trainer.json), BOS the one its post-processor puts first (prepare-data keeps it), else the
    declared bos_token (tokenizer_config.json), pad the declared pad_token, else EOS. Those there is
    none of are left out."""
    if (tok_file := checkpoint_tokenizer(ckpt, saved_recipe)) is None:
        return {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": EOS}
    tok = load_tokenizer(str(tok_file))
    before, ids = added_around(tok)[0], {f"{k}_id": tok.token_to_id(v) for k, v in declared_tokens(ckpt).items()}
    eos = (json.loads((ckpt / TRAINER).read_text()).get("data") or {}).get("eos_id")  # what the documents ended with
    ids = {"bos_token_id": before[0] if before else ids.get("bos_token_id"), "eos_token_id": eos,
           "pad_token_id": ids.get("pad_token_id", eos)}
    return {k: v for k, v in ids.items() if v is not None}


@torch.no_grad()
def export(ckpt, out, dtype: torch.dtype = torch.bfloat16, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write `ckpt` (verified) as a Hugging Face checkpoint into `out`; every rank calls it."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    path = resolve(ckpt, check=lambda c: agree(None, c, verify, c, rank, world))  # every rank a share
    cfg, saved = checkpoint_recipe(path)
    refuse_hub_losses(cfg.model, f"{path / RECIPE}")  # a model field config.json cannot carry
    checkpoint_tokenizer(path, saved)  # before any file is written
    model = build_model(cfg.model, init=False)  # meta: names, shapes, tied head
    out = Path(out)
    state = state_for_export(model)
    check_index(path, [f"{k}.{n}" for n in state for k in ("model", "lean")[:1 + lean_checkpoint(path)]])
    refuse_trained_bias(path, model)
    lean = lean_checkpoint(path)  # the masters as two halves: joined (kernels/adamw.join_)

    def native(name):  # one native tensor in memory at a time, read from the checkpoint
        one = {f"model.{name}": torch.empty(state[name].shape, dtype=torch.float32)}
        if lean:
            one[f"lean.{name}"] = torch.empty(state[name].shape, dtype=torch.int16)
        read_tensors(path, one, checked=True)  # every tensor's index entry checked above
        value = one.pop(f"model.{name}")
        if lean:
            join_(value, one.pop(f"lean.{name}"))
        return value

    special = special_token_ids(path, saved)  # every rank, before any file: an error is every rank's
    write_hub(out, model.cfg, state, dtype, shard_bytes, native, special, rank, world,
              say=(lambda line: print(f"export: {line}", flush=True)) if rank == 0 else None)
    if rank == 0:
        (out / "generation_config.json").write_text(json.dumps(special, indent=2))
        print(f"export: {copy_tokenizer(path, saved, out)}", flush=True)
    return out


def refuse_trained_bias(path: Path, model: torch.nn.Module):
    """model.balance=bias: a trained routing bias (balance.bias_E, not zero) has no place in the hub
    format, and transformers would route without it; save_hf refuses it too."""
    biases = {f"model.{n}": torch.empty(b.shape) for n, b in model.named_buffers() if n.endswith("balance.bias_E")}
    if not biases:
        return
    read_tensors(path, biases)
    if trained := [n.removeprefix("model.") for n, b in biases.items() if b.any()]:
        raise ConfigError(f"{path}: {trained[0]}: the trained routing bias (model.balance=bias) has no place in "
                          f"{model.cfg.hf_architecture}'s hub format; transformers would route without it. Keep "
                          "the native checkpoint (invoke sample), or train with another model.balance")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pithtrain.checkpoint.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="step_N dir, checkpoints dir or run dir")
    p.add_argument("--out", required=True, help="output directory (Hugging Face layout)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the weights' dtype")
    p.add_argument("--shard-mb", type=int, default=SHARD_BYTES >> 20, help="output shard size (MB)")
    args = p.parse_args(argv)  # `invoke export-hf` takes every option (tests/test_appliance.py)
    if args.shard_mb < 1:
        p.error("--shard-mb must be >= 1")
    torchrun = int(os.environ.get("WORLD_SIZE", 1)) > 1
    if torchrun and not dist.is_initialized():  # files only: gloo is enough, on any machine
        dist.init_process_group("gloo")
    try:
        export(args.ckpt, args.out, getattr(torch, args.dtype), args.shard_mb << 20)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if torchrun:
            dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"export: wrote {args.out} ({args.dtype})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
