"""Hugging Face checkpoints: import from and export to a local directory (config.json + safetensors).

    model = load_hf("path/to/Qwen3-30B-A3B")           # model(input_ids) -> logits (B, S, V)
    save_hf(model, "out/")                              # transformers.AutoModelForCausalLM loads it

Import streams tensor by tensor: the model is allocated once (on `device`, in `dtype`) and each hub
tensor is read from its shard, converted by the family's `hf_to_native` (per-expert keys into
slices of the stacked expert tensors, MXFP4 dequantised) and copied in place, so the checkpoint is
never held in memory twice. Every parameter element must be written exactly once; anything
missing, unknown or of the wrong shape is an error naming the file.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pithtrain.config import check_model_values
from pithtrain.models import FAMILIES, build_model, to_empty
from pithtrain.models.balance import Balance
from pithtrain.models.common import Rotary

SHARD_BYTES = 4 << 30  # export shard size


def family_of(config_json: dict, source: Path) -> str:
    archs = config_json.get("architectures") or []
    for name, fam in FAMILIES.items():
        if fam.config.hf_architecture in archs:
            return name
    supported = ", ".join(f.config.hf_architecture for f in FAMILIES.values())
    raise ValueError(f"{source}: unsupported architecture {archs or config_json.get('model_type')!r} "
                     f"(supported: {supported})")


def read_config(path: Path):
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file}: no config.json in the checkpoint directory")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e.msg})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object, got {type(hf).__name__}")
    for k, v in hf.items():  # "hidden_size": "4096" would reach comparisons and allocations
        if isinstance(v, str) and re.fullmatch(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*", v):
            raise ValueError(f"{cfg_file}: {k} is the string {v!r}, not a number")
    family = family_of(hf, cfg_file)
    def fail(key, msg):
        raise ValueError(f"{key}: {msg}")

    try:
        cfg = FAMILIES[family].config.from_hf(hf)
        check_model_values(cfg, fail)  # sizes typed and bounded before anything is allocated
    except (KeyError, ValueError, TypeError) as e:  # TypeError: a size given as a string
        raise ValueError(f"{cfg_file}: cannot read {family} config: {type(e).__name__}: {e}") from None
    return family, cfg


def shard_files(path: Path) -> dict[str, Path]:
    """hub key -> file holding it, from model.safetensors.index.json or a single model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = set(weight_map.values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        root = path.resolve()
        for f in names:  # the index may only name files inside the checkpoint directory
            if not isinstance(f, str) or not (path / f).resolve().is_relative_to(root):
                raise ValueError(f"{index}: weight_map names {f!r}, outside {path}")
        files = {f: path / f for f in names}
        for f in files.values():
            if not f.is_file():
                raise FileNotFoundError(f"{f}: shard listed in {index.name} is missing")
        return {k: files[f] for k, f in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json found")
    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


@torch.no_grad()
def load_hf(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
            **config_overrides) -> torch.nn.Module:
    """Build the family's model from a Hugging Face checkpoint directory (weights copied exactly;
    `config_overrides` replace fields of the imported config, e.g. aux_loss_coeff=0)."""
    path = Path(path)
    family, cfg = read_config(path)
    for k, v in config_overrides.items():
        setattr(cfg, k, v)
    fam = FAMILIES[family]
    model = build_model(cfg, init=False)  # on meta: sizes are known before anything is allocated
    _check_fits(path, sum(p.numel() for p in model.parameters()) * dtype.itemsize, torch.device(device))
    model = to_empty(model, device)
    model.to(dtype)
    for m in model.modules():  # buffers that are not in checkpoints; RoPE's table stays float32
        if isinstance(m, (Rotary, Balance)):  # (in bf16, cos/sin at position 30000 are off by up to
            m.float().reset_parameters()  # ~2); the balance=bias bias starts at zero (no family's hub has it)
    params = dict(model.named_parameters())
    written = {name: 0 for name in params}
    key_file = shard_files(path)
    handles = {}

    def get(key: str) -> torch.Tensor:
        if key not in key_file:
            raise KeyError(f"{path}: tensor {key!r} not found in any shard")
        f = key_file[key]
        if f not in handles:
            handles[f] = safe_open(f, "pt", device="cpu")
        return handles[f].get_tensor(key)

    for key in sorted(key_file, key=lambda k: (str(key_file[k]), k)):
        if key == "lm_head.weight" and cfg.tie_word_embeddings:  # the embedding, written once
            continue
        try:
            slices = fam.hf_to_native(cfg, key, get)
        except KeyError:
            raise ValueError(f"{key_file[key]}: unexpected tensor {key!r} for {family}") from None
        for name, index, value in slices:
            if name not in params and value.numel() == 0:  # e.g. DeepSeek's zero-width shared experts
                continue  # (n_shared_experts=0: transformers saves empty tensors, this model has none)
            if name not in params:
                raise ValueError(f"{key_file[key]}: tensor {key!r} maps to unknown parameter {name!r}")
            target = params[name][index] if index else params[name]
            if tuple(target.shape) != tuple(value.shape):
                raise ValueError(f"{key_file[key]}: tensor {key!r} has shape {tuple(value.shape)}, "
                                 f"expected {tuple(target.shape)} for {name}")
            target.copy_(value.to(dtype))
            written[name] += value.numel()
    handles.clear()
    missing = [n for n, p in params.items() if written[n] != p.numel()]
    if missing:
        raise ValueError(f"{path}: checkpoint does not cover {len(missing)} parameters, e.g. {missing[:3]}")
    return model


def _check_fits(path: Path, nbytes: int, device: torch.device):
    """The whole model is allocated on `device` (then sharded): refuse what cannot fit."""
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[1]
    elif device.type == "cpu":
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    else:
        return
    if nbytes > have:
        raise ValueError(f"{path / 'config.json'}: describes a model of {nbytes / 1e9:.1f} GB, more than the "
                         f"{have / 1e9:.1f} GB of {device} it is loaded into")


def state_for_export(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unique parameters by native name (a tied LM head is written once, as the embedding)."""
    seen, out = set(), {}
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out[name] = p.detach()
    return out


@torch.no_grad()
def save_hf(model: torch.nn.Module, path: str | Path, dtype: torch.dtype | None = None,
            shard_bytes: int = SHARD_BYTES):
    """Write config.json and safetensors shards (+ index when sharded) in the hub layout. Weight
    files of an earlier export into the same folder are removed first: transformers would load a
    stale model.safetensors next to a new sharded index. Other files (a tokenizer) stay."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    cfg = model.cfg
    fam = FAMILIES[cfg.family]
    for name, b in model.named_buffers():  # balance=bias: no supported hub format has the bias
        if name.endswith("balance.bias_E") and b.any():  # (DeepSeek-V3's e_score_correction_bias)
            raise ValueError(f"{name}: the trained routing bias (model.balance=bias) has no place in "
                             f"{cfg.hf_architecture}'s hub format; transformers would route without it")
    state = state_for_export(model)
    dtype = dtype or next(iter(state.values())).dtype
    hf_cfg = {**cfg.to_hf(), "torch_dtype": str(dtype).removeprefix("torch."),
              "dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    shards, current, size = [], {}, 0
    for name, t in state.items():
        for key, value in fam.native_to_hf(cfg, name, t):
            current[key] = value.to("cpu", dtype).contiguous()
            size += current[key].numel() * current[key].element_size()
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
    if current or not shards:
        shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
