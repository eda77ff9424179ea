"""Typed run configuration: YAML recipes -> dataclasses, with errors that name the file and the key.

A recipe has six sections (model, train, data, parallel, checkpoint, log). The model section names a
`family`; its other keys fill that family's config dataclass (defined at the top of its model file).
Unknown keys, wrong types and impossible values raise `ConfigError` with one line:

    recipes/x.yaml: train.lr: expected a number, got 'fast'

Command-line overrides `section.key=value` are parsed as YAML scalars and applied on top of the file.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

RECIPES_DIR = Path(__file__).parent / "recipes"
DEFAULT_RECIPE = RECIPES_DIR / "default.yaml"


class ConfigError(ValueError):
    """A recipe problem, phrased for a person: '<file>: <key>: <what is allowed>'."""


# ---------------------------------------------------------------------------------------------
# Sections (the model section's dataclass lives in the family's model file)


@dataclass
class TrainConfig:
    steps: int = 200
    micro_batch_size: int = 8
    seq_len: int = 128
    grad_accum: int = 1  # micro-batches per optimizer step (per data-parallel rank)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global L2 norm; 0 disables clipping
    seed: int = 1234
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    compile: bool = False  # torch.compile(fullgraph=True) on the non-MoE parts (CUDA only)
    activation_checkpoint: Literal["none", "full", "selective"] = "none"  # see pithtrain/compile.py
    kernels: Literal["auto", "torch"] = "auto"  # auto: fused operators where available (kernels/)
    fp8: bool = False
    init_from: str | None = None  # a Hugging Face checkpoint directory to start from

    def validate(self, err):
        for k in ("steps", "micro_batch_size", "seq_len", "grad_accum"):
            if getattr(self, k) < 1:
                err(k, f"must be >= 1, got {getattr(self, k)}")
        # Written so that nan fails too (every comparison with nan is false); inf is no setting either.
        for k in ("lr", "eps"):
            if not 0 < getattr(self, k) < math.inf:
                err(k, f"must be a finite number > 0, got {getattr(self, k)}")
        if not 0 <= self.min_lr_ratio <= 1:
            err("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            err("warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.weight_decay < math.inf:
            err("weight_decay", f"must be a finite number >= 0, got {self.weight_decay}")
        if not 0 <= self.grad_clip < math.inf:
            err("grad_clip", f"must be a finite number >= 0 (0 disables), got {self.grad_clip}")
        for k in ("beta1", "beta2"):
            if not 0 <= getattr(self, k) < 1:
                err(k, f"must be in [0, 1), got {getattr(self, k)}")
        if self.init_from is not None and not Path(self.init_from).is_dir():
            err("init_from", f"directory {self.init_from!r} does not exist")


@dataclass
class DataConfig:
    source: Literal["stdlib", "shards"] = "stdlib"
    path: str | None = None  # shards: a directory written by `invoke prepare-data`
    max_bytes: int = 4_000_000  # stdlib: how much of the interpreter's own source to read

    def validate(self, err):
        if self.source == "shards":
            if self.path is None:
                err("path", "data.source is 'shards' but no data.path is given")
            elif not (Path(self.path) / "meta.json").is_file():
                err("path", f"{self.path!r} is not a token-shard directory (no meta.json); "
                            "create one with `invoke prepare-data`")
        if self.max_bytes < 10_000:
            err("max_bytes", f"must be >= 10000, got {self.max_bytes}")


@dataclass
class ParallelConfig:
    pp: int = 1
    dp: int = 1  # replicated data parallel (outer)
    fsdp: int = 1  # fully-sharded data parallel
    cp: int = 1  # context parallel (sequence split)
    ep: int = 1  # expert parallel (borrowed from fsdp x cp ranks)
    pp_schedule: Literal["1f1b", "dualpipev"] = "1f1b"
    pp_microbatches: int = 0  # 0: use train.grad_accum
    pp_layers: list | None = None  # layers per stage (virtual stage for dualpipev); None: balanced
    pp_overlap: bool = True  # CUDA: F&B pairs put communication phases on their own stream

    def validate(self, err):
        for k in ("pp", "dp", "fsdp", "cp", "ep"):
            if getattr(self, k) < 1:
                err(k, f"must be >= 1, got {getattr(self, k)}")


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between saves; 0: only at the end when `final` is set
    keep_last: int = 2
    final: bool = True
    async_save: bool = True  # on CUDA; CPU saves are synchronous
    weights_only: bool = False  # the final save holds the model alone (hand-off: 1/3 the size, no resume)
    export_hf: bool = False  # after the final save, write <run_dir>/hf (Hugging Face layout)
    export_dtype: Literal["bfloat16", "float32"] = "bfloat16"

    def validate(self, err):
        if self.every < 0:
            err("every", f"must be >= 0, got {self.every}")
        if self.keep_last < 1:
            err("keep_last", f"must be >= 1, got {self.keep_last}")
        for k in ("weights_only", "export_hf"):
            if getattr(self, k) and not self.final:
                err(k, "acts on the final save; set checkpoint.final=true")


@dataclass
class LogConfig:
    every: int = 10
    run_dir: str = "runs/default"
    peak_tflops: float = 0.0  # 0: look up the GPU in metrics.PEAK_TFLOPS; CPU has none

    def validate(self, err):
        if self.every < 1:
            err("every", f"must be >= 1, got {self.every}")


@dataclass
class Config:
    model: Any  # the family's config dataclass
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    source: str = "<dict>"  # where it came from, for messages

    def to_dict(self) -> dict:
        d = {"model": {"family": self.model.family, **dataclasses.asdict(self.model)}}
        for s in ("train", "data", "parallel", "checkpoint", "log"):
            d[s] = dataclasses.asdict(getattr(self, s))
        return d

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SECTIONS = {"train": TrainConfig, "data": DataConfig, "parallel": ParallelConfig,
            "checkpoint": CheckpointConfig, "log": LogConfig}


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Load a recipe file (None: the embedded default) and apply `section.key=value` overrides."""
    path = Path(path) if path is not None else DEFAULT_RECIPE
    if not path.is_file():
        named = RECIPES_DIR / f"{path}.yaml"  # `qwen3-30b-a3b` names an embedded recipe
        if named.is_file():
            path = named
        else:
            known = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
            raise ConfigError(f"{path}: no such recipe file (embedded recipes: {known})")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of sections, got {type(raw).__name__}")
    for o in overrides:
        apply_override(raw, o, str(path))
    return config_from_dict(raw, source=str(path))


def apply_override(raw: dict, override: str, source: str = "<overrides>"):
    if "=" not in override or "." not in override.split("=", 1)[0]:
        raise ConfigError(f"override {override!r}: expected section.key=value, e.g. train.lr=1e-3")
    key, value = override.split("=", 1)
    *parents, leaf = key.split(".")
    node = raw
    for p in parents:
        if node.get(p) is None:  # absent, or `train:` with nothing under it: an empty section
            node[p] = {}
        node = node[p]
        if not isinstance(node, dict):
            raise ConfigError(f"{source}: override {override!r}: {p} is not a section (it is {node!r})")
    node[leaf] = yaml.safe_load(value) if value != "" else None


def config_from_dict(raw: dict, source: str = "<dict>", cross_checks: bool = True) -> Config:
    """A typed Config from a recipe dict. `cross_checks=False` skips the checks between sections
    (vocabulary against the data, sequence length against the model), for readers that use the
    model section alone, such as export, where the training data need not exist."""
    from pithtrain.models import FAMILIES  # the one literal mapping family -> (config, model)

    def fail(key, msg):
        raise ConfigError(f"{source}: {key}: {msg}")

    allowed = ["model", *SECTIONS]
    for k in raw:
        if k not in allowed:
            fail(k, f"unknown section{_suggest(k, allowed)}; sections are {', '.join(allowed)}")

    def section(name) -> dict:
        sec = raw.get(name)
        if sec is None:  # absent, or `train:` with nothing under it
            return {}
        if not isinstance(sec, dict):
            fail(name, f"expected a mapping of keys, got {sec!r}")
        return sec

    model_raw = dict(section("model"))
    family = model_raw.pop("family", "qwen3_moe")
    if not isinstance(family, str) or family not in FAMILIES:  # a list is unhashable: no `in` on it
        fail("model.family", f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    model_cls = FAMILIES[family].config
    all_classes = {"model": model_cls, **SECTIONS}
    built = {"model": _build(model_cls, model_raw, "model", fail, all_classes)}
    for name, cls in SECTIONS.items():
        built[name] = _build(cls, section(name), name, fail, all_classes)
    if built["train"].init_from:  # the checkpoint's config.json defines the model trained; the
        from pithtrain.checkpoint.hf import read_config  # recipe keeps only its aux_loss_coeff
        try:
            hub = read_config(Path(built["train"].init_from))[1]
        except (OSError, ValueError) as e:
            fail("train.init_from", str(e))
        hub.aux_loss_coeff = built["model"].aux_loss_coeff
        built["model"] = hub
    cfg = Config(**built, source=source)
    if cross_checks:
        _cross_checks(cfg, fail)
    return cfg


def _build(cls, values: dict, section: str, fail, all_classes):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for k, v in values.items():
        if k not in fields:
            elsewhere = [s for s, c in all_classes.items() if s != section
                         and k in {f.name for f in dataclasses.fields(c)}]
            hint = f"; did you mean {elsewhere[0]}.{k}?" if elsewhere else _suggest(k, fields)
            fail(f"{section}.{k}", f"unknown key{hint} (allowed: {', '.join(fields)})")
        kwargs[k] = _coerce(v, hints[k], f"{section}.{k}", fail)
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        obj.validate(lambda key, msg: fail(f"{section}.{key}", msg))
    return obj


def _coerce(v, tp, key, fail):
    """Check `v` against a field annotation; YAML's '1e-3' (a string in YAML 1.1) becomes a float."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if v is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(v, inner[0], key, fail)
    if origin is Literal:
        choices = typing.get_args(tp)
        if v not in choices:
            fail(key, f"expected one of {', '.join(map(repr, choices))}, got {v!r}")
        return v
    if tp is bool:
        if not isinstance(v, bool):
            fail(key, f"expected true or false, got {v!r}")
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            fail(key, f"expected an integer, got {v!r}")
        return v
    if tp is float:
        if isinstance(v, str):
            try:
                return float(v)
            except ValueError:
                pass
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            fail(key, f"expected a number, got {v!r}")
        return float(v)
    if tp is str:
        if not isinstance(v, str):
            fail(key, f"expected a string, got {v!r}")
        return v
    if tp is list or origin is list:
        if not isinstance(v, list):
            fail(key, f"expected a list, got {v!r}")
        return v
    return v


def _suggest(key, options) -> str:
    close = difflib.get_close_matches(key, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _cross_checks(cfg: Config, fail):
    from pithtrain.data import DATA_VOCAB_SIZE, read_meta

    model = cfg.model  # with train.init_from, the checkpoint's (config_from_dict)
    field = ("train.init_from's config.json {}" if cfg.train.init_from else "model.{}").format
    if cfg.data.source == "stdlib" and model.vocab_size < DATA_VOCAB_SIZE:
        fail(field("vocab_size"), f"the byte-level stdlib data needs >= {DATA_VOCAB_SIZE}, got {model.vocab_size}")
    if cfg.data.source == "shards":  # here, before any model is built: ids >= vocab_size crash step 1
        try:
            vocab = read_meta(cfg.data.path)["vocab_size"]
        except ConfigError as e:
            fail("data.path", str(e))
        if model.vocab_size < vocab:
            fail(field("vocab_size"), f"{model.vocab_size} is smaller than the vocabulary of the token shards "
                                      f"in {cfg.data.path!r} ({vocab}, from meta.json); token ids would "
                                      "index past the embedding")
    if cfg.train.seq_len > model.max_position_embeddings:
        fail("train.seq_len", f"{cfg.train.seq_len} exceeds {field('max_position_embeddings')} "
                              f"({model.max_position_embeddings})")
