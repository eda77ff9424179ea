"""The run's precision, decided once from the recipe, the device and the layout, and passed to
whoever needs it (the train step, the pipeline, evaluation, the bench, the memory plan, kernels).

    precision = Precision.of(cfg.train, device, dims)     # build.build_run
    with precision.weights(model):                         # one optimizer step's micro-batches
        with precision.autocast():                         # the forward; backward outside it
            loss = model(x_BS, labels_BS=y_BS)
        loss.backward()

What it decides (CUDA's default compute is bf16: train.dtype auto or bfloat16; CPU computes float32):

    layout                        compute  FSDP gathers  bf16 copy (`copies`)    gradients accumulate in
    float32 (CPU, dtype=float32)  float32  float32       none                    float32 .grad (FSDP: its shards)
    bf16, no FSDP (one GPU,       bf16     -             every float32 weight    the float32 master's .grad
      pipeline stages alone)
    bf16, FSDP                    bf16     bf16          none                    FSDP's sharded .grad, reduced in
                                                                                 train.reduce_dtype
    bf16, FSDP, experts alone     bf16     bf16 (dense)  the routed experts      their masters' .grad; the rest FSDP's
      (dims.experts_alone)

The training state (`state`, STATES): "float32", the reference, keeps float32 masters, gradients
and AdamW moments (16 B per parameter, plus 2 B where a bf16 copy exists); "bf16" keeps bf16
parameters and moments and no masters (the bench's comparison with its peers, which run that). A
leaner state (masters as bf16 plus a 16-bit remainder, bf16 moments) is one more entry of STATES:
its bf16 half is the compute weight, so `WeightCopies` holds the halves where it now holds the copy,
and the plan and the optimizer read its bytes and dtypes from here.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pithtrain.models.common import GroupedExperts, local

# Bytes per parameter of a training state: weights (the masters), gradients, optimizer moments.
STATES = {"float32": (4, 4, 8), "bf16": (2, 2, 4)}


@dataclass
class Precision:
    compute: torch.dtype = torch.float32  # what the layers compute in (bf16: under autocast)
    device_type: str = "cpu"
    reduce: torch.dtype = torch.float32  # FSDP's gradient reduce-scatter (train.reduce_dtype)
    copy: str = "none"  # which weights have a bf16 copy: "none", "all" (no FSDP), "experts" (FSDP leaves them out)
    state: str = "float32"  # STATES
    copies: WeightCopies | None = field(init=False, repr=False)

    def __post_init__(self):
        self.copies = WeightCopies(self.copy) if self.copy != "none" else None

    @classmethod
    def of(cls, train_cfg, device: torch.device, dims, state: str = "float32") -> Precision:
        """The run's precision: the table in the module docstring."""
        bf16 = device.type == "cuda" and train_cfg.dtype in ("auto", "bfloat16")
        copy = "none"
        if bf16 and state == "float32":  # float32 masters: the layers compute on a bf16 copy or FSDP's gathers
            copy = "experts" if dims.experts_alone else "none" if dims.fsdp_enabled else "all"
        return cls(torch.bfloat16 if bf16 else torch.float32, device.type, getattr(torch, train_cfg.reduce_dtype),
                   copy, state)

    def autocast(self):
        """The forward's context: autocast to the compute dtype, or nothing in float32. Backward runs
        outside it (train.forward_backward, pipeline.PipelineRunner)."""
        if self.compute == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute)

    def fsdp_policy(self):
        """FSDP2's MixedPrecisionPolicy: gathers in the compute dtype, reduce-scatters in `reduce`;
        the sharded parameters (the masters) stay as they are."""
        from torch.distributed.fsdp import MixedPrecisionPolicy
        return MixedPrecisionPolicy(param_dtype=self.compute, reduce_dtype=self.reduce)

    def weights(self, model: nn.Module):
        """Around one optimizer step's micro-batches: the bf16 copies in place of the masters (WeightCopies.swap),
        or nothing where there are none."""
        return self.copies.swap(model) if self.copies is not None else contextlib.nullcontext()

    def bytes_per_param(self) -> dict:
        """Bytes of the training state per parameter (the memory plan): weights, grads, optimizer
        moments, and the bf16 copy where a weight has one."""
        w, g, m = STATES[self.state]
        return {"weights": w, "grads": g, "optimizer": m, "copy": 2 if self.copies is not None else 0}


class WeightCopies:
    """The bf16 copy of float32 master weights: the numbers of FSDP's MixedPrecisionPolicy without
    FSDP. Inside `swap` (one optimizer step) every float32 parameter in scope is replaced in its
    module by a bf16 leaf holding its value, and each micro-batch's bf16 gradient is added into the
    master's float32 .grad as autograd accumulates it (float32 accumulation, as FSDP's float32
    reduction; kernels/wgrad.py writes the gradients it makes there directly, asking `master`); on
    exit the modules hold the masters again, so clip, AdamW, checkpoints and export see only float32.
    Plain autocast would cast every weight in each micro-batch's forward and recompute, cast and
    accumulate each gradient on its own: 20% of a 4-layer Qwen3 step at 8 micro-batches
    (docs/perf-notes.md).

    The copy is made once and kept here, keyed by its master (which it points back to weakly). On
    entry it is refreshed by a cast unless kernels/adamw.py already wrote the updated value into it
    in its pass (`copy_of`, then `written`), which marks it with the master's version and storage:
    any later in-place change through torch moves the version on, a new tensor the storage, and the
    cast runs again. A write through `p.data`, which torch does not count, is not seen: change
    masters between steps through torch ops (as checkpoint loading does).
    scope: "all" (every float32 parameter) or "experts" (the routed experts' only: those FSDP leaves
    out, distributed/parallelize.py)."""

    def __init__(self, scope: str):
        self.scope = scope
        self._copy: dict[int, tuple] = {}  # id(master) -> (weakref to the master, its bf16 leaf)
        self._master: dict[int, weakref.ref] = {}  # id(bf16 leaf) -> weakref to its master
        self._fresh: dict[int, tuple] = {}  # id(master) -> (version, storage) the copy was last made from

    @contextlib.contextmanager
    def swap(self, model: nn.Module):
        slots = [(mod, name, p) for mod in model.modules() if self.scope == "all" or isinstance(mod, GroupedExperts)
                 for name, p in mod._parameters.items() if p is not None and p.dtype == torch.float32]
        leaves = {id(p): self._current(p) for _, _, p in slots}  # tied parameters share one copy
        for mod, name, p in slots:
            mod._parameters[name] = leaves[id(p)]
        try:
            yield
        finally:
            for mod, name, p in slots:
                mod._parameters[name] = p

    def _current(self, p: torch.Tensor) -> nn.Parameter:
        """p's bf16 copy holding p's value: made (first use, or p's shape, device or requires_grad
        changed), refreshed by a cast, or as it is when AdamW wrote it."""
        entry, src = self._copy.get(id(p)), local(p)  # a DTensor master (experts): its local block
        b = entry[1] if entry is not None and entry[0]() is p else None
        if b is None or b.shape != src.shape or b.device != p.device or b.requires_grad != p.requires_grad:
            if b is not None:
                self._master.pop(id(b), None)
            b = nn.Parameter(src.detach().to(torch.bfloat16), requires_grad=p.requires_grad)
            ref = weakref.ref(p, functools.partial(self._forget, id(p)))
            self._copy[id(p)], self._master[id(b)] = (ref, b), ref
            if p.requires_grad:
                b.register_post_accumulate_grad_hook(functools.partial(_into_master, ref))
        elif self._fresh.get(id(p)) != _stamp(p):
            with torch.no_grad():
                b.copy_(src)
        self._fresh[id(p)] = _stamp(p)
        return b

    def _forget(self, key: int, ref) -> None:
        entry = self._copy.get(key)
        if entry is not None and entry[0] is ref:
            del self._copy[key]
            self._master.pop(id(entry[1]), None)
            self._fresh.pop(key, None)

    def master(self, w: torch.Tensor) -> torch.Tensor | None:
        """The float32 master whose .grad the bf16 copy w's gradient goes into (kernels/wgrad.py), or None."""
        ref = self._master.get(id(w))
        return ref() if ref is not None else None

    def copy_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """The bf16 copy of master p, for kernels/adamw.py to write the updated value into, or None."""
        entry = self._copy.get(id(p))
        return entry[1] if entry is not None and entry[0]() is p else None

    def written(self, p: torch.Tensor) -> None:
        """kernels/adamw.py wrote p's updated value into its copy: no cast at the next swap."""
        self._fresh[id(p)] = _stamp(p)


def _stamp(p: torch.Tensor) -> tuple:
    return p._version, p.data_ptr()


def _into_master(ref: weakref.ref, b: torch.Tensor) -> None:
    if b.grad is None:  # kernels/wgrad.py added this micro-batch's gradient into master.grad itself
        return
    master = ref()
    if master.grad is None:
        g = b.grad.to(master.dtype)
        master.grad = (DTensor.from_local(g, master.device_mesh, master.placements, run_check=False,
                                          shape=master.shape, stride=master.stride())
                       if isinstance(master, DTensor) else g)
    else:
        local(master.grad).add_(b.grad)
    b.grad = None
