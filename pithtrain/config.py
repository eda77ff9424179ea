"""Typed run configuration: YAML recipes -> dataclasses, with errors that name the file and the key.

A recipe has six sections (model, train, data, parallel, checkpoint, log). The model section names a
`family`; its other keys fill that family's config dataclass (defined at the top of its model file).
Unknown keys, wrong types and impossible values raise `ConfigError` with one line:

    recipes/x.yaml: train.lr: expected a number, got 'fast'

Command-line overrides `section.key=value` are parsed as YAML scalars and applied on top of the file.

    python -m pithtrain.config RECIPE train.lr=1e-3      # the resolved recipe (invoke config RECIPE --set ...)
    python -m pithtrain.config RECIPE --keys             # every key: type, default, the recipe's value
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from pithtrain import ConfigError, check  # with the package: data.py and models/ use them without this module

RECIPES_DIR = Path(__file__).parent / "recipes"
DEFAULT_RECIPE = RECIPES_DIR / "default.yaml"

# Model fields a recipe owns even with train.init_from; the hub's config.json owns the family's `hub_fields` (what
# its to_hf writes) but these. Every field of a family config is in one of the two (tests/test_config.py), so a new
# field (a variant's switch) is classified when it is added: one config.json cannot carry belongs here.
# balance, bias_update_rate, z_loss_coeff: models/balance.py; swiglu_alpha: GPT-OSS's hub fixes it.
RECIPE_MODEL_FIELDS = ("aux_loss_coeff", "balance", "bias_update_rate", "z_loss_coeff", "swiglu_alpha")


def field_default(f: dataclasses.Field):
    """A dataclass field's default value (a fresh one where it has a default_factory)."""
    return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()


def changed_fields(model) -> list[tuple[str, Any]]:
    """(field, value) of each field of a dataclass that is not at its default."""
    return [(f.name, getattr(model, f.name)) for f in dataclasses.fields(model)
            if getattr(model, f.name) != field_default(f)]


# ---------------------------------------------------------------------------------------------
# Sections (the model section's dataclass lives in the family's model file)


# The largest train.beta2 train.state=lean's bf16 second moment follows: beta2 * v must round away
# from v for every bf16 mantissa (1 - beta2 >= 2^-7, the widest relative spacing), or v stops decaying.
LEAN_MAX_BETA2 = 0.99


@dataclass
class TrainConfig:
    steps: int = 200
    micro_batch_size: int = 8
    seq_len: int = 128
    grad_accum: int = 1  # micro-batches per optimizer step (per data-parallel rank)
    # tokens per optimizer step over every rank; null: micro_batch_size x grad_accum per data-parallel
    # rank is the step. Set: micro_batch_size x grad_accum x data-parallel ranks x seq_len must be it,
    # and under `parallel: auto` the planner chooses micro_batch_size and grad_accum for it (plan.py)
    global_batch_tokens: int | None = None
    lr: float = 3e-3
    warmup_steps: int = 20  # linear warmup to lr, then the schedule (train.lr_lambda)
    # cosine / linear: from the end of warmup to the last step; wsd (warmup-stable-decay): lr held
    # until the last decay_ratio of train.steps, then decay_type; constant: lr. All end at lr * min_lr_ratio.
    lr_schedule: Literal["cosine", "wsd", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.1
    decay_ratio: float = 0.2  # wsd: the share of train.steps that decays (a longer run: a longer stable phase)
    decay_type: Literal["linear", "cosine", "sqrt"] = "linear"  # wsd's decay; sqrt: 1 - sqrt(progress)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global L2 norm; 0 disables clipping
    seed: int = 1234
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU; bfloat16: both
    compile: bool = False  # torch.compile(fullgraph=True) on the non-MoE parts (CUDA only)
    # see pithtrain/compile.py; auto: the planner chooses with the layout (plan.resolve, pithtrain/plan.py)
    activation_checkpoint: Literal["none", "cheap", "selective", "full", "auto"] = "none"
    kernels: Literal["auto", "torch"] = "auto"  # auto: fused operators where available (kernels/)
    fp8: bool = False
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"  # FSDP's gradient reduce-scatter (parallelize.py)
    # the training state (pithtrain/precision.py): float32 masters, gradients and moments (16 B per
    # parameter), or lean: the same float32 masters as a bf16 parameter + an int16 remainder, bf16
    # moments, float32 gradients only over several micro-batches (8-10 B); lean needs bf16 compute
    state: Literal["float32", "lean"] = "float32"
    init_from: str | None = None  # a Hugging Face checkpoint directory to start from
    eval_every: int = 0  # steps between validation-loss evaluations (val_loss in the log); 0: none
    eval_batches: int = 4  # global batches per evaluation
    # a non-finite loss or gradient norm: stop (the run ends, exit 1) or skip (that optimizer step is
    # dropped on every rank: no weight, optimizer state or balancing bias moves), stopping after
    # max_skips consecutive skips (docs/reliability.md)
    on_nonfinite: Literal["stop", "skip"] = "stop"
    max_skips: int = 3

    def validate(self, err):
        check(self, err, "steps micro_batch_size seq_len grad_accum eval_batches max_skips", lambda v: v >= 1, ">= 1")
        check(self, err, "lr eps", lambda v: 0 < v < math.inf, "a finite number > 0")
        check(self, err, "min_lr_ratio decay_ratio", lambda v: 0 <= v <= 1, "in [0, 1]")
        if self.lr_schedule != "wsd" and (self.decay_ratio, self.decay_type) != (0.2, "linear"):
            err("decay_ratio" if self.decay_ratio != 0.2 else "decay_type",
                f"applies to train.lr_schedule=wsd only (it is {self.lr_schedule!r})")
        if self.global_batch_tokens is not None and (self.global_batch_tokens < 1
                                                     or self.global_batch_tokens % self.seq_len):
            err("global_batch_tokens", f"must be a positive multiple of train.seq_len ({self.seq_len}), got "
                                       f"{self.global_batch_tokens}")
        check(self, err, "eval_every", lambda v: v >= 0, ">= 0 (0: no evaluation)")
        check(self, err, "warmup_steps", lambda v: v >= 0, ">= 0")
        check(self, err, "weight_decay", lambda v: 0 <= v < math.inf, "a finite number >= 0")
        check(self, err, "grad_clip", lambda v: 0 <= v < math.inf, "a finite number >= 0 (0 disables)")
        check(self, err, "beta1 beta2", lambda v: 0 <= v < 1, "in [0, 1)")
        if self.state == "lean" and self.beta2 > LEAN_MAX_BETA2:
            err("beta2", f"{self.beta2} is above {LEAN_MAX_BETA2}, the largest train.state=lean's bf16 second moment "
                         "follows (beta2 * v would round back to v); lower it or set train.state=float32")
        if self.state == "lean" and self.dtype == "float32":
            err("state", "lean keeps bf16 weights and needs bf16 compute, but train.dtype is float32 "
                         "(set train.dtype=bfloat16 or auto, or train.state=float32)")
        if self.init_from is not None and not Path(self.init_from).is_dir():
            err("init_from", f"directory {self.init_from!r} does not exist")


@dataclass
class DataConfig:
    source: Literal["stdlib", "shards"] = "stdlib"
    path: str | None = None  # shards: a directory written by `invoke prepare-data`
    max_bytes: int = 4_000_000  # stdlib: how much of the interpreter's own source to read
    val_path: str | None = None  # shards for validation (train.eval_every); None: hold out 1% of path's
    document_mask: bool = False  # attention stays inside each document; positions restart per document
    mask_separator_loss: bool = False  # no loss on predicting a document's first token from its separator
    # resume onto shards of another tokenizer than the checkpoint's (refused otherwise: the ids change meaning)
    allow_tokenizer_change: bool = False
    # epochs: each epoch a seeded permutation of the data's windows (one pass); random: windows drawn
    # at random starts with replacement (the sampler before epochs)
    sampler: Literal["epochs", "random"] = "epochs"

    def validate(self, err):
        if self.source == "stdlib" and self.path is not None:
            err("path", f"{self.path!r} is given but data.source is 'stdlib' (the interpreter's own bytes); "
                        "set data.source=shards to train on it")
        for k in ("val_path", "path") if self.source == "shards" else ("val_path",):
            if getattr(self, k) is not None and not (Path(getattr(self, k)) / "meta.json").is_file():
                err(k, f"{getattr(self, k)!r} is not a token-shard directory (no meta.json); "
                       "create one with `invoke prepare-data`")
        if self.source == "shards" and self.path is None:
            err("path", "data.source is 'shards' but no data.path is given")
        check(self, err, "max_bytes", lambda v: v >= 10_000, ">= 10000")


# what checkpoint.on_signal may name: a notice a scheduler sends (SIGKILL and SIGSTOP cannot be caught)
CATCHABLE_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")
LAYOUT_KEYS = ("pp", "dp", "fsdp", "cp", "ep")


@dataclass
class ParallelConfig:
    """`parallel: auto` (or `{auto: true, ep: 2}`): the sizes left unset are chosen at start-up
    from the world size, the model and the GPU's memory (pithtrain/plan.py:resolve: a new Config
    with them; this one keeps None); the ones given are kept. Without auto an unset size is 1."""
    auto: bool = False
    pp: int | None = None
    dp: int | None = None  # replicated data parallel (outer)
    fsdp: int | None = None  # fully-sharded data parallel
    cp: int | None = None  # context parallel (sequence split)
    ep: int | None = None  # expert parallel (borrowed from a stage's fsdp x cp, or dp x fsdp x cp, ranks)
    pp_schedule: Literal["1f1b", "dualpipev"] | None = None  # None: 1f1b, or auto's choice
    pp_layers: list | None = None  # layers per stage (virtual stage for dualpipev); None: balanced
    # DualPipeV's F&B pairs interleave one micro-batch's forward phases with another's backward,
    # each expert all-to-all (dispatch, combine) under a compute phase of the other (on CUDA on
    # its own stream); false: F then B. Errors where there is nothing to overlap. None: false, or
    # auto's choice.
    pp_overlap: bool | None = None
    # seconds a collective may wait before the run ends with a diagnosis (docs/reliability.md);
    # torch's own default is 10 (NCCL) or 30 (gloo) minutes
    timeout_s: float = 300.0

    def __post_init__(self):
        if not self.auto:
            for k in LAYOUT_KEYS:
                if getattr(self, k) is None:
                    setattr(self, k, 1)
            self.pp_schedule = self.pp_schedule or "1f1b"
            self.pp_overlap = bool(self.pp_overlap)

    def validate(self, err):
        check(self, err, " ".join(LAYOUT_KEYS), lambda v: v >= 1, ">= 1")  # None: auto chooses it
        check(self, err, "timeout_s", lambda v: 0 < v < math.inf, "a finite number of seconds > 0")
        if self.pp_overlap:
            why = ("needs parallel.pp and parallel.ep given explicitly under parallel: auto"
                   if self.pp is None or self.ep is None else
                   "needs a pipeline (pp > 1)" if self.pp == 1 else
                   "needs pp_schedule=dualpipev (1f1b has no forward-backward pairs)"
                   if self.pp_schedule != "dualpipev" else
                   "needs expert parallelism (ep > 1): without it dispatch and combine are local "
                   "permutes, with no communication to hide" if self.ep == 1 else None)
            if why:
                err("pp_overlap", f"{why}; set parallel.pp_overlap=false")


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between saves; 0: only at the end when `final` is set
    every_minutes: float = 0.0  # also save at the first step this long after the last save; 0: off
    # signals that save the step just finished and stop (SIGINT too, always): docs/reliability.md
    on_signal: list = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    keep_last: int = 2
    final: bool = True
    async_save: bool = True  # on CUDA; CPU saves are synchronous
    weights_only: bool = False  # the final save holds the model alone (hand-off: 1/3 the size, no resume)
    export_hf: bool = False  # after the final save, write <run_dir>/hf (Hugging Face layout)
    export_dtype: Literal["bfloat16", "float32"] = "bfloat16"

    def validate(self, err):
        check(self, err, "every", lambda v: v >= 0, ">= 0")
        check(self, err, "every_minutes", lambda v: 0 <= v < math.inf, "a finite number >= 0 (0: off)")
        for name in self.on_signal:
            if name not in CATCHABLE_SIGNALS:
                err("on_signal", f"{name!r} is not one of {', '.join(CATCHABLE_SIGNALS)}")
        check(self, err, "keep_last", lambda v: v >= 1, ">= 1")
        for k in ("weights_only", "export_hf"):
            if getattr(self, k) and not self.final:
                err(k, "acts on the final save; set checkpoint.final=true")


@dataclass
class LogConfig:
    every: int = 10
    run_dir: str = "runs/default"
    peak_tflops: float = 0.0  # 0: the GPU's in pithtrain/gpus.py (metrics.peak_tflops); CPU has none
    tensorboard: bool = True  # event files in <run_dir>/tensorboard (`tensorboard --logdir <run_dir>`)
    wandb: str | None = None  # a Weights & Biases project to log to (needs the wandb package)

    def validate(self, err):
        check(self, err, "every", lambda v: v >= 1, ">= 1")
        for key, pkg in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
            if getattr(self, key) and importlib.util.find_spec(pkg) is None:
                err(key, f"needs the {pkg} package (pip install {pkg}), or set log.{key}="
                         f"{'false' if key == 'tensorboard' else 'null'}")


@dataclass
class Config:
    model: Any  # the family's config dataclass
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    source: str = "<dict>"  # where it came from, for messages
    notes: list = field(default_factory=list)  # what loading resolved (model.vocab_size: auto), said at start-up

    def to_dict(self) -> dict:
        return {"model": {"family": self.model.family, **dataclasses.asdict(self.model)},
                **{s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS}}

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
        raw = yaml.load(path.read_bytes().decode("utf-8"), _UniqueKeyLoader)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of sections, got {type(raw).__name__}")
    raw = _parallel_shorthand(raw)  # before overrides: `parallel: auto` + parallel.ep=2
    by_key = {}
    for o in overrides:
        apply_override(raw, o)
        by_key[o.split("=", 1)[0]] = o
    try:
        cfg = config_from_dict(raw, source=str(path))
    except ConfigError as e:  # a value that came from the command line: name the override
        key = getattr(e, "key", None)
        o = key and next((o for k, o in by_key.items() if k == key or k.startswith(key + ".")), None)
        if o is not None:
            raise ConfigError(f"command-line override {o!r}: {e.key}: {e.detail}") from None
        if key is None or not by_key:
            raise
        # the file's value, or a default, refused together with overrides (its section's, else all)
        near = [o for k, o in by_key.items() if k.split(".")[0] == key.split(".")[0]] or list(by_key.values())
        raise ConfigError(f"{path} with command-line override{'s' * (len(near) > 1)} "
                          f"{', '.join(map(repr, near))}: {e.key}: {e.detail}") from None
    chosen = [o for k, o in by_key.items() if k in ("train.micro_batch_size", "train.grad_accum")]
    if chosen and cfg.parallel.auto and cfg.train.global_batch_tokens is not None:  # not dropped silently
        raise ConfigError(f"command-line override {chosen[0]!r}: parallel: auto chooses train.micro_batch_size "
                          f"and train.grad_accum for train.global_batch_tokens={cfg.train.global_batch_tokens}; "
                          "add train.global_batch_tokens=null to keep yours")
    return cfg


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):
                continue  # the constructor below names an unhashable key itself
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (line {key_node.start_mark.line + 1})", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def apply_override(raw: dict, override: str):
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
            raise ConfigError(f"override {override!r}: {p} is not a section (it is {node!r})")
    try:
        node[leaf] = yaml.safe_load(value) if value != "" else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: not a YAML value: {' '.join(str(e).split())}") from None


def config_from_dict(raw: dict, source: str = "<dict>", cross_checks: bool = True) -> Config:
    """A typed Config from a recipe dict. `cross_checks=False` skips the checks between sections
    (vocabulary against the data, sequence length against the model), for readers that use the
    model section alone, such as export, where the training data need not exist."""
    from pithtrain.models import FAMILIES, read_config  # the one literal mapping family -> (config, model)

    def fail(key, msg):
        e = ConfigError(f"{source}: {key}: {msg}")
        e.key, e.detail = key, msg  # load_config names a command-line override that set it
        raise e

    raw = _parallel_shorthand(raw)
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
    built = {name: _build(cls, section(name), name, fail, all_classes) for name, cls in SECTIONS.items()}
    notes = []
    if model_raw.get("vocab_size") == "auto" and built["train"].init_from:
        del model_raw["vocab_size"]  # the checkpoint's config.json has it
    elif model_raw.get("vocab_size") == "auto":  # the data's vocabulary, padded for the kernels
        model_raw["vocab_size"], what = _auto_vocab(built["data"], fail)
        notes.append(f"model.vocab_size: auto -> {model_raw['vocab_size']} ({what}, padded to a multiple "
                     f"of {VOCAB_MULTIPLE})")
    built["model"] = _build(model_cls, model_raw, "model", fail, all_classes)
    if built["train"].init_from:  # the checkpoint's config.json defines the model trained; the
        try:  # recipe keeps its RECIPE_MODEL_FIELDS
            hub = read_config(Path(built["train"].init_from))[1]
        except (OSError, ValueError) as e:
            fail("train.init_from", str(e))
        hub_fields = {f.name for f in dataclasses.fields(hub)}
        for k in RECIPE_MODEL_FIELDS:
            if k in hub_fields and hasattr(built["model"], k):
                setattr(hub, k, getattr(built["model"], k))
            elif k in model_raw:  # the recipe's family has the option, the checkpoint's has not
                fail(f"model.{k}", f"{type(hub).__name__} (train.init_from's family) has no such field")
        for k, v in changed_fields(built["model"]):  # neither config.json nor the recipe would give the model this
            if k not in RECIPE_MODEL_FIELDS and k not in type(hub).hub_fields:
                fail(f"model.{k}", f"{v!r} would be lost: " + (
                    "train.init_from's config.json has no key for it; keep it in RECIPE_MODEL_FIELDS "
                    "(pithtrain/config.py)" if k in hub_fields else f"{type(hub).__name__} (train.init_from's "
                    "family) has no such field"))
        built["model"] = hub
    t = built["train"]
    if t.warmup_steps > t.steps:  # a short trial of a recipe is legitimate: said, not refused
        notes.append(f"WARNING: train.warmup_steps {t.warmup_steps} > train.steps {t.steps}: the run ends in its "
                     f"warm-up, the last step at {t.steps / t.warmup_steps:.0%} of train.lr, and the LR schedule's "
                     "decay never starts (set train.warmup_steps below train.steps for the whole schedule)")
    cfg = Config(**built, source=source, notes=notes)
    if cross_checks:
        _cross_checks(cfg, fail)
    return cfg


VOCAB_MULTIPLE = 64  # model.vocab_size: auto rounds up to it: whole tensor-core tiles for the head's matmul


def _auto_vocab(data: DataConfig, fail) -> tuple[int, str]:
    from pithtrain.data import DATA_VOCAB_SIZE, read_meta

    n, what = DATA_VOCAB_SIZE, "the stdlib bytes' vocabulary"
    if data.source == "shards":
        try:
            n, what = read_meta(data.path)["vocab_size"], f"{Path(data.path) / 'meta.json'} vocab_size"
        except ConfigError as e:
            fail("data.path", str(e))
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE, f"{what} {n}"


def _parallel_shorthand(raw: dict) -> dict:
    """`parallel: auto` is `parallel: {auto: true}`."""
    return {**raw, "parallel": {"auto": True}} if raw.get("parallel") == "auto" else raw


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
    if tp is float and isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            pass
    if (origin or tp) not in _KINDS:
        return v
    kinds, want = _KINDS[origin or tp]
    if isinstance(v, bool) is not (tp is bool) or not isinstance(v, kinds):  # YAML's true is no number
        fail(key, f"expected {want}, got {v!r}")
    return float(v) if tp is float else v


# annotation -> (the Python types a YAML value of it may have, what the error says is expected)
_KINDS = {bool: (bool, "true or false"), int: (int, "an integer"), float: ((int, float), "a number"),
          str: (str, "a string"), list: (list, "a list")}


def _suggest(key, options) -> str:
    close = difflib.get_close_matches(key, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _cross_checks(cfg: Config, fail):
    """The recipe's sections against each other and the data files, at load (no layout, no
    device: what needs those is build.check_run's, after plan.resolve)."""
    from pithtrain.data import DATA_VOCAB_SIZE, check_token_ids, read_meta, tokenizer_fingerprint

    model = cfg.model  # with train.init_from, the checkpoint's (config_from_dict)
    field = ("train.init_from's config.json {}" if cfg.train.init_from else "model.{}").format
    if cfg.data.source == "stdlib" and model.vocab_size < DATA_VOCAB_SIZE:
        fail(field("vocab_size"), f"the byte-level stdlib data needs >= {DATA_VOCAB_SIZE}, got {model.vocab_size}")
    if cfg.data.val_path and (cfg.data.source != "shards" or not cfg.train.eval_every):
        fail("data.val_path", "is read only by evaluation on shards: set data.source=shards and train.eval_every")
    hub_tok = Path(cfg.train.init_from or "") / "tokenizer.json"
    if cfg.train.init_from and cfg.data.source == "stdlib" and hub_tok.is_file():
        fail("data.source", f"'stdlib' feeds byte ids to train.init_from's model, whose tokenizer is {hub_tok}; "
                            "tokenize the data with it (`invoke prepare-data --tokenizer "
                            f"{cfg.train.init_from}`) and set data.source=shards")
    meta = {}
    for key in ("path", "val_path") if cfg.data.source == "shards" else ():
        if getattr(cfg.data, key) is None:
            continue
        try:  # here, before any model is built: ids >= vocab_size crash step 1
            meta[key] = read_meta(getattr(cfg.data, key))
            check_token_ids(getattr(cfg.data, key), meta[key])  # out of vocabulary, dtype, names
        except ConfigError as e:
            fail(f"data.{key}", str(e))
        try:
            want = tokenizer_fingerprint(hub_tok) if hub_tok.is_file() else meta["path"].get("tokenizer_sha256")
        except ImportError:
            fail("train.init_from", "checking its tokenizer.json against the shards needs the tokenizers "
                                    "package (pip install -e '.[data]')")
        if want and meta[key].get("tokenizer_sha256") != want:
            fail(f"data.{key}", f"{getattr(cfg.data, key)!r} was tokenized with {meta[key].get('tokenizer')}, "
                                f"not with {hub_tok if hub_tok.is_file() else meta['path'].get('tokenizer')} "
                                "(meta.json tokenizer_sha256 differs); re-run `invoke prepare-data` with that "
                                "tokenizer")
    if cfg.data.document_mask and cfg.data.source == "shards" and meta["path"].get("eos_id") is None:
        fail("data.document_mask", f"{cfg.data.path!r} has no document separator (meta.json eos_id); "
                                   "re-create it with `invoke prepare-data` and a tokenizer that has an EOS token")
    if cfg.data.source == "shards":
        vocab = meta["path"]["vocab_size"]
        if model.vocab_size < vocab:
            fail(field("vocab_size"), f"{model.vocab_size} is smaller than the vocabulary of the token shards "
                                      f"in {cfg.data.path!r} ({vocab}, from meta.json); token ids would "
                                      "index past the embedding")
    if cfg.train.seq_len > model.max_position_embeddings:
        fail("train.seq_len", f"{cfg.train.seq_len} exceeds {field('max_position_embeddings')} "
                              f"({model.max_position_embeddings})")


# ---------------------------------------------------------------------------------------------
# Entry point (`invoke config`)


def _type_name(tp) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Literal:
        return " | ".join(map(repr, args))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def keys_table(cfg: Config) -> str:
    """Every key of the recipe's sections (the model's: its family's): type, default, and the
    recipe's value where it is not the default."""
    rows = []
    for name in ("model", *SECTIONS):
        obj = getattr(cfg, name)
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            default = field_default(f)
            tp = _type_name(hints[f.name]) + (" | 'auto'" if (name, f.name) == ("model", "vocab_size") else "")
            value = getattr(obj, f.name)
            rows.append((f"{name}.{f.name}", tp, repr(default), "" if value == default else f"recipe: {value!r}"))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{k:<{width[0]}}  {t:<{width[1]}}  {d:<{width[2]}}  {v}".rstrip() for k, t, d, v in rows)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys
    p = argparse.ArgumentParser(prog="python -m pithtrain.config", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="?", default=None, help="recipe YAML file or embedded recipe name")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.add_argument("--keys", action="store_true", help="every key with its type and default")
    args = p.parse_intermixed_args(argv)
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe:  # only overrides were given
        recipe, overrides = None, [recipe, *overrides]
    try:
        cfg = load_config(recipe, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    notes = "".join(f"# {n}\n" for n in cfg.notes)
    header = f"# {cfg.source} {' '.join(overrides)}".rstrip()
    print(keys_table(cfg) if args.keys else f"{header}\n{notes}{cfg.to_yaml().rstrip()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
