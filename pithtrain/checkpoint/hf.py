"""Hugging Face checkpoints: import from and export to a local directory (config.json + safetensors).

    model = load_hf("path/to/Qwen3-30B-A3B")           # model(input_ids) -> logits (B, S, V)
    save_hf(model, "out/")                              # transformers.AutoModelForCausalLM loads it

    load_hf_into(meta_model, "path/", device)             # train.init_from: this rank's slices only

Import streams tensor by tensor: the model is allocated once (on `device`, in `dtype`; under
FSDP / EP / pp only this rank's shard) and each hub tensor, or the rows of it this rank holds, is
read from its shard, converted by the family's `hf_to_native` (per-expert keys into slices of the
stacked expert tensors, MXFP4 dequantised) and copied in place, so the checkpoint is never held in
memory twice. Every parameter element must be written; anything missing, unknown or of the wrong
shape is an error naming the file. Export of a model in memory is `save_hf`; of a training
checkpoint, streamed from disk, checkpoint/export.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from pithtrain.checkpoint.dcp import TRAINING_ONLY
from pithtrain.config import ConfigError, changed_fields
from pithtrain.models import FAMILIES, build_model, read_config, to_empty
from pithtrain.models.balance import Balance, BalanceConfig
from pithtrain.models.common import Rotary, local

SHARD_BYTES = 4 << 30  # export shard size
READ_BYTES = 8 << 20  # import: rows of a hub tensor read and converted at a time (float32 size)


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
    model = build_model(cfg, init=False).to(dtype)  # meta: no memory until load_hf_into
    load_hf_into(model, path, device)
    return model


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


def _owned(t: torch.Tensor) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """([start, stop) per dim of the global tensor this rank holds, the local tensor holding it)."""
    if isinstance(t, DTensor):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        assert tuple(local.shape) == tuple(shape), (tuple(local.shape), tuple(shape))
        return [(o, o + s) for o, s in zip(offset, shape)], local
    return [(0, s) for s in t.shape], t


def _index_box(index: tuple, shape) -> tuple[list[tuple[int, int]], list[int]]:
    """The region `tensor[index]` covers ([start, stop) per dim) and the dims an int index drops."""
    box, dropped = [], []
    for d, n in enumerate(shape):
        i = index[d] if d < len(index) else slice(None)
        if isinstance(i, int):
            box.append((i, i + 1))
            dropped.append(d)
        else:
            start, stop, step = i.indices(n)
            assert step == 1, index
            box.append((start, stop))
    return box, dropped


def _mapped(fam, cfg, key: str, name: str, index: tuple, get) -> torch.Tensor:
    """The value `fam.hf_to_native` gives for (name, index) from hub tensor `key`, read by `get`."""
    return next(v for n, ix, v in fam.hf_to_native(cfg, key, get) if n == name and ix == index)


def _copy(local, owned, value, value_box, inter) -> int:
    """Copy the region `inter` (global coordinates) from `value` (covering `value_box`) into
    `local` (covering `owned`); returns the number of elements written."""
    src = tuple(slice(a - v, b - v) for (a, b), (v, _) in zip(inter, value_box))
    dst = tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inter, owned))
    local[dst].copy_(value[src])
    return local[dst].numel()


@torch.no_grad()
def load_hf_into(model: torch.nn.Module, path: str | Path, device: str | torch.device = "cpu"):
    """Fill `model`, built on the meta device and possibly pruned to a pipeline stage and
    parallelized (FSDP / expert-parallel DTensors), with this rank's part of a hub checkpoint.

    The model is allocated here (to_empty: only this rank's shards, on `device`, in the dtype of
    each parameter). Every hub tensor is first mapped on the meta device (the family's
    `hf_to_native`, with shapes from the safetensors headers: no data read), which says which
    parameter region it fills; a tensor whose region this rank does not hold is never read. A
    value filling a whole parameter (per-layer tensors, fused experts, MXFP4 blocks) keeps the
    hub tensor's dim 0, so only the rows this rank holds are read (`safe_open(...).get_slice`),
    and MXFP4 blocks are dequantised for those experts only; per-expert hub tensors (Qwen3,
    DeepSeek) are read whole when this rank holds any of them (one expert's matrix). Files are
    opened one at a time, so the pages mapped from them stay bounded by one file. Host memory:
    this rank's shard (when `device` is CPU) + one read piece (READ_BYTES, or one expert's
    matrix) and its converted copy; device memory: the shard.

    safe_open/get_slice rather than DCP's Hugging Face reader: the hub-to-native mapping is not
    1:1 (per-expert tensors are slices of stacked ones, transposed; MXFP4 is two tensors to
    decode), so a DCP key adapter would still need this planning, and DCP's reader copies whole
    tensors before it narrows them. Every parameter element this rank holds must be written;
    anything missing, unknown or of the wrong shape is an error naming the file."""
    path = Path(path)
    cfg = model.cfg
    fam = FAMILIES[cfg.family]
    whole = build_model(cfg, init=False)  # meta: names and full shapes (a pipeline stage has a subset)
    whole_targets = {**dict(whole.named_parameters()), **dict(whole.named_buffers())}
    _check_fits(path, sum(local(p).numel() * p.element_size()
                          for p in model.parameters()), torch.device(device))  # this rank's shards
    to_empty(model, device)
    for m in model.modules():  # buffers that are not in checkpoints; RoPE's table stays float32
        if isinstance(m, (Rotary, Balance)):  # (in bf16, cos/sin at position 30000 are off by up
            m.float().reset_parameters()  # to ~2); the balance=bias bias starts at zero (no hub has it)
    targets = {n: _owned(t) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    written: dict[str, int] = {}  # elements written per target
    key_file = shard_files(path)
    handles: dict[Path, object] = {}

    def handle(key: str):
        if key not in key_file:
            raise KeyError(f"{path}: tensor {key!r} not found in any shard")
        f = key_file[key]
        if f not in handles:
            handles[f] = safe_open(f, "pt", device="cpu")
        return handles[f]

    def shape_only(key: str) -> torch.Tensor:
        sl = handle(key).get_slice(key)
        return torch.empty(sl.get_shape(), dtype=_DTYPES[sl.get_dtype()], device="meta")

    files = sorted(set(key_file.values()))
    t0 = last = time.monotonic()
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    for i, f in enumerate(files):
        for key in sorted(k for k, v in key_file.items() if v == f):
            if key == "lm_head.weight" and cfg.tie_word_embeddings:  # the embedding, written once
                continue
            try:
                plan = fam.hf_to_native(cfg, key, shape_only)
            except KeyError:
                raise ValueError(f"{f}: unexpected tensor {key!r} for {cfg.family}") from None
            for name, index, meta in plan:
                if name not in whole_targets and meta.numel() == 0:  # e.g. DeepSeek's zero-width
                    continue  # shared experts (n_shared_experts=0: transformers saves empty tensors)
                if name not in whole_targets:
                    raise ValueError(f"{f}: tensor {key!r} maps to unknown parameter {name!r}")
                full = whole_targets[name]
                region, dropped = _index_box(index, full.shape)
                if tuple(full[index].shape) != tuple(meta.shape):
                    raise ValueError(f"{f}: tensor {key!r} has shape {tuple(meta.shape)}, "
                                     f"expected {tuple(full[index].shape)} for {name}")
                if name not in targets:  # another pipeline stage's
                    continue
                owned, block = targets[name]
                inter = [(max(a, o), min(b, p)) for (a, b), (o, p) in zip(region, owned)]
                if any(a >= b for a, b in inter):
                    continue  # another rank's slice: not read
                if index or meta.ndim == 0:  # a slice of a parameter (one expert's matrix): read whole
                    value = _mapped(fam, cfg, key, name, index, lambda k: handle(k).get_tensor(k))
                    for d in dropped:
                        value = value.unsqueeze(d)
                    written[name] = written.get(name, 0) + _copy(block, owned, value, region, inter)
                    continue
                # A whole-parameter value keeps the hub tensor's dim 0: read the rows this rank
                # holds, READ_BYTES of float32 at a time (one GPT-OSS-120B expert layer is 8.5 GB).
                step = max(1, READ_BYTES // max(1, meta[0].numel() * 4))
                for r0 in range(inter[0][0], inter[0][1], step):
                    rows = (r0, min(r0 + step, inter[0][1]))
                    value = _mapped(fam, cfg, key, name, index,
                                    lambda k: handle(k).get_slice(k)[rows[0]:rows[1]])
                    if value.shape[0] != rows[1] - rows[0]:
                        raise AssertionError(f"{cfg.family}.hf_to_native must keep dim 0 of {key!r}")
                    part = [rows, *inter[1:]]
                    written[name] = written.get(name, 0) + _copy(block, owned, value, [rows, *region[1:]], part)
        handles.clear()  # unmaps the file: its pages leave this process
        if rank0 and (i + 1 == len(files) or time.monotonic() - last >= 10):  # minutes at 30B scale
            last = time.monotonic()
            print(f"init_from: {path}: read {i + 1} of {len(files)} files ({last - t0:.0f} s)", flush=True)
    missing = [n for n, p in model.named_parameters() if written.get(n, 0) != targets[n][1].numel()]
    if missing:
        raise ValueError(f"{path}: checkpoint does not cover {len(missing)} parameters, e.g. {missing[:3]}")
    return model


def _check_fits(path: Path, nbytes: int, device: torch.device):
    """This rank's shards of the model (`nbytes`) are allocated on `device`: refuse what cannot fit
    before allocating (a hub config.json's sizes are not to be trusted)."""
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


def refuse_hub_losses(model, what: str):
    """A ConfigError naming each field of a model config that a Hugging Face config.json would drop:
    not in the family's `hub_fields` (what its to_hf writes), not at its default, and shaping the
    forward (the balancing fields and dcp.TRAINING_ONLY do not; a trained balance=bias bias is
    save_hf's own check). Export and save_hf call it: transformers would load the model without it."""
    kept = {f.name for f in dataclasses.fields(BalanceConfig)} | set(TRAINING_ONLY) | set(type(model).hub_fields)
    if lost := [f"model.{k}={v!r}" for k, v in changed_fields(model) if k not in kept]:
        raise ConfigError(f"{what}: {', '.join(lost)} would be lost: {type(model).hf_architecture}'s config.json "
                          f"has no key for it ({type(model).__name__}.hub_fields), so transformers would build the "
                          "model without it. Keep the native checkpoint, or train with it at its default")


@torch.no_grad()
def save_hf(model: torch.nn.Module, path: str | Path, dtype: torch.dtype | None = None,
            shard_bytes: int = SHARD_BYTES):
    """Write config.json and safetensors shards (+ index when sharded) in the hub layout (write_hub)."""
    path = Path(path)
    refuse_hub_losses(model.cfg, f"save_hf {path}")  # a field config.json cannot carry, before any file changes
    cfg = model.cfg
    for name, b in model.named_buffers():  # balance=bias: no supported hub format has the bias
        if name.endswith("balance.bias_E") and b.any():  # (DeepSeek-V3's e_score_correction_bias)
            raise ValueError(f"{name}: the trained routing bias (model.balance=bias) has no place in "
                             f"{cfg.hf_architecture}'s hub format; transformers would route without it")
    state = state_for_export(model)
    write_hub(path, cfg, state, dtype or next(iter(state.values())).dtype, shard_bytes, state.get)


def plan_shards(hub: dict[str, list], dtype: torch.dtype, shard_bytes: int) -> list[list[str]]:
    """Native parameter names per output shard, from the shapes of their hub tensors (`hub`: native
    name -> [(hub key, meta tensor)]): a shard takes tensors until the next would pass shard_bytes
    (the hub tensors of one native tensor stay together, so a shard is larger only when one native
    tensor is)."""
    shards, current, size = [], [], 0
    for name, tensors in hub.items():
        nbytes = sum(v.numel() for _, v in tensors) * dtype.itemsize
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


_ST_DTYPES = {dtype: name for name, dtype in _DTYPES.items()}


def write_streaming(path: Path, layout: list[tuple[str, tuple]], dtype: torch.dtype, tensors):
    """A safetensors file written as its tensors come: the header (from `layout`, (key, shape) in
    order) first, then each tensor of the iterator `tensors` ((key, value) in the same order).
    safetensors' save_file needs the whole shard in memory twice (dict + serialised bytes);
    this needs one tensor."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, shape in layout:
        n = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for (key, shape), (got, value) in zip(layout, tensors, strict=True):
            if got != key or tuple(value.shape) != tuple(shape):
                raise AssertionError(f"{path.name}: {got} {tuple(value.shape)} where the header has {key} {shape}")
            f.write(value.to("cpu", dtype).contiguous().view(torch.uint8).numpy())
        f.flush()
        os.fsync(f.fileno())


def write_hub(path: Path, cfg, state: dict, dtype: torch.dtype, shard_bytes: int, native,
              config: dict | None = None, rank: int = 0, world: int = 1, say=None):
    """config.json (the family's to_hf, `config`, the dtype) and the weights in the hub layout, for
    save_hf and export: shards planned from the shapes alone (plan_shards of `state`, native name ->
    tensor: its values are not read), each written as its tensors come (write_streaming; `native(name)`
    gives one native tensor's value, converted by the family's native_to_hf when its shard is
    written), rank r writing shards r, r + world, ... (`say` each one); an index when
    sharded. Weight files of an earlier export into the same folder are removed first: transformers
    would load a stale model.safetensors next to a new sharded index. Other files (a tokenizer) stay."""
    fam = FAMILIES[cfg.family]
    hub = {n: list(fam.native_to_hf(cfg, n, t.to("meta"))) for n, t in state.items()}  # shapes
    shards = plan_shards(hub, dtype, shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        for old in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:
            old.unlink(missing_ok=True)
    if world > 1:
        dist.barrier()
    t0 = time.monotonic()
    for i in range(rank, len(shards), world):
        write_streaming(path / names[i], [(k, tuple(v.shape)) for n in shards[i] for k, v in hub[n]], dtype,
                        (kv for n in shards[i] for kv in fam.native_to_hf(cfg, n, native(n))))
        if say is not None:
            say(f"wrote {names[i]} ({i + 1} of {len(shards)}, {time.monotonic() - t0:.0f} s)")
    if world > 1:
        dist.barrier()
    if rank == 0:
        dt = str(dtype).removeprefix("torch.")
        (path / "config.json").write_text(json.dumps({**cfg.to_hf(), **(config or {}), "torch_dtype": dt,
                                                      "dtype": dt}, indent=2))
        if len(shards) > 1:
            weight_map = {k: names[i] for i, s in enumerate(shards) for n in s for k, _ in hub[n]}
            total = sum(v.numel() for tensors in hub.values() for _, v in tensors) * dtype.itemsize
            (path / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
