"""The run's precision, decided once from the recipe, the device and the layout, and passed to
whoever needs it (the train step, the pipeline, evaluation, the bench, the memory plan, kernels).

    precision = Precision.of(cfg.train, device, dims)     # build.build_run
    with precision.weights(model):                         # one optimizer step's micro-batches
        with precision.autocast():                         # the forward; backward outside it
            loss = model(x_BS, labels_BS=y_BS)
        loss.backward()

What it decides (compute is bf16 with train.dtype=bfloat16, and on CUDA with auto; else float32):

    layout                        compute  FSDP gathers  bf16 copy (`copies`)    gradients accumulate in
    float32 (CPU, dtype=float32)  float32  float32       none                    float32 .grad (FSDP: its shards)
    bf16, no FSDP (one GPU,       bf16     -             every float32 weight    the float32 master's .grad
      pipeline stages alone)
    bf16, FSDP                    bf16     bf16          none                    FSDP's sharded .grad, reduced in
                                                                                 train.reduce_dtype
    bf16, FSDP, experts alone     bf16     bf16 (dense)  the routed experts      their masters' .grad; the rest FSDP's
      (dims.experts_alone)

The training state (`state`: train.state, STATES), bytes per parameter:

    state    weights (masters)          gradients                 AdamW moments    bf16 copy
    float32  4: float32                 4: float32                8: float32       2 where the table says
    lean     4: bf16 + int16 remainder  2: bf16 (one micro-       4: bf16 m, v     none: the high half is
             (exactly the float32)      batch); 4: float32 over                    the compute weight
                                        several (LeanState)
    bf16     2: bf16, no masters        2                         4                none (the bench's peers)

"float32" is the reference. "lean" keeps the same float32 masters in two halves (kernels/adamw.py's
split / join: the parameter IS the bf16 high half, rounded to nearest with ties away from zero, and
LeanState holds the int16 low half beside it), so the layers and FSDP's gathers use the parameter with no
copy and no cast, and kernels/adamw.py's AdamW (its lean pass) updates the joined float32 value
with the float32 arithmetic, then splits it again; its moments are bf16 (train.beta2 at most
config.LEAN_MAX_BETA2: the second moment's decay must move a bf16 value). A step of several
micro-batches adds each micro-batch's bf16 gradient into a float32 buffer (LeanState's hook;
kernels/wgrad.py writes there directly), one micro-batch uses its bf16 gradient as it is. It needs bf16 compute
(build.check_run refuses it otherwise). Its loss curve against float32's: docs/perf-notes.md.
"bf16" keeps bf16 parameters and moments and no masters (the bench's comparison with its peers).

`keep` (FSDP without a pipeline, where the memory plan fits it: plan.py): the decoder layers'
dense parameters stay gathered from a step's first forward to its end (FSDP2's
reshard_after_forward / _after_backward off; `weights` reshards them on exit, before the
optimizer), so a step of several micro-batches gathers each layer once instead of twice per
micro-batch (distributed/parallelize.py).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pithtrain.kernels.adamw import split
from pithtrain.kernels.wgrad import writable
from pithtrain.models.common import GroupedExperts, local, placed_like

# Bytes per parameter of a training state: weights (the masters), gradients, optimizer moments
# (lean's gradients: 2 with one micro-batch a step, 4 with several: bytes_per_param).
STATES = {"float32": (4, 4, 8), "lean": (4, 2, 4), "bf16": (2, 2, 4)}


@dataclass
class Precision:
    compute: torch.dtype = torch.float32  # what the layers compute in (bf16: under autocast)
    device_type: str = "cpu"
    reduce: torch.dtype = torch.float32  # FSDP's gradient reduce-scatter (train.reduce_dtype)
    copy: str = "none"  # which weights have a bf16 copy: "none", "all" (no FSDP), "experts" (FSDP leaves them out)
    state: str = "float32"  # STATES
    accumulate: bool = False  # several micro-batches a step (lean: float32 gradient buffers)
    keep: bool = False  # FSDP keeps the dense layers gathered across a step (the module docstring)
    fsdp: bool = False  # FSDP shards the parameters (dims.fsdp_enabled)
    copies: WeightCopies | None = field(init=False, repr=False)
    lean: LeanState | None = field(init=False, repr=False)
    kept: list = field(init=False, repr=False)  # the FSDP modules `keep` holds gathered (parallelize)

    def __post_init__(self):
        self.copies = WeightCopies(self.copy) if self.copy != "none" else None
        self.lean = LeanState(self.accumulate) if self.state == "lean" else None
        self.kept = []

    @classmethod
    def of(cls, train_cfg, device: torch.device, dims, state: str | None = None, keep: bool | None = None
           ) -> Precision:
        """The run's precision: the tables in the module docstring. `state`: train.state unless
        given (the bench's "bf16"); `keep`: FSDP without a pipeline unless given (the memory plan's
        answer, plan.py)."""
        state = state or train_cfg.state
        bf16 = train_cfg.dtype == "bfloat16" or (device.type == "cuda" and train_cfg.dtype == "auto")
        copy = "none"
        if bf16 and state == "float32":  # float32 masters: the layers compute on a bf16 copy or FSDP's gathers
            copy = "experts" if dims.experts_alone else "none" if dims.fsdp_enabled else "all"
        keep = dims.fsdp_enabled and not dims.pp_enabled if keep is None else keep and dims.fsdp_enabled
        return cls(torch.bfloat16 if bf16 else torch.float32, device.type, getattr(torch, train_cfg.reduce_dtype),
                   copy, state, train_cfg.grad_accum > 1, keep, dims.fsdp_enabled)

    def autocast(self):
        """The forward's context: autocast to the compute dtype, or nothing in float32. Backward runs
        outside it (train.forward_backward, pipeline.PipelineRunner)."""
        if self.compute == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute)

    def fsdp_policy(self):
        """FSDP2's MixedPrecisionPolicy: gathers in the compute dtype, reduce-scatters in `reduce`;
        the sharded parameters (float32 masters, or lean's bf16 halves: no cast) stay as they are."""
        from torch.distributed.fsdp import MixedPrecisionPolicy
        return MixedPrecisionPolicy(param_dtype=self.compute, reduce_dtype=self.reduce)

    @contextlib.contextmanager
    def weights(self, model: nn.Module):
        """Around one optimizer step's micro-batches: the bf16 copies in place of the masters (WeightCopies.swap),
        and on exit the layers `keep` held gathered resharded; nothing where there is neither."""
        try:
            with self.copies.swap(model) if self.copies is not None else contextlib.nullcontext():
                yield
        finally:
            for m in self.kept:
                m.reshard()

    @property
    def sink(self):
        """What the in-place weight gradients (kernels/wgrad.py) ask where a weight's gradient goes:
        the bf16 copies' masters, lean's float32 buffers, or None (models.common.use_kernels binds it)."""
        return self.copies if self.copies is not None else self.lean if self.accumulate else None

    def grads(self, params) -> list[torch.Tensor]:
        """The step's gradients of `params` (the norm, the clip): lean's float32 buffers where it
        accumulates, else each .grad."""
        return [g for p in params if (g := self.lean.grad(p) if self.lean else p.grad) is not None]

    def bytes_per_param(self) -> dict:
        """Bytes of the training state per parameter (the memory plan): weights, grads, optimizer
        moments, and the bf16 copy where a weight has one."""
        w, g, m = STATES[self.state]
        if self.state == "lean" and self.accumulate:
            g = 4
        return {"weights": w, "grads": g, "optimizer": m, "copy": 2 if self.copies is not None else 0}

    def describe(self) -> str:
        """The start-up line: compute, the state and its bytes, the bf16 copies, FSDP's gathers."""
        b = self.bytes_per_param()
        copy = f", + {b['copy']} B bf16 copy of {self.copy}" if b["copy"] else ""
        dtype = str(self.compute).removeprefix("torch.")
        cast = "no cast" if self.state != "float32" or self.compute == torch.float32 else "cast from float32"
        keep = "the dense layers kept gathered across the step" if self.keep else "gathered per micro-batch"
        gathers = f"; FSDP gathers {dtype} ({cast}), {keep}" if self.fsdp else ""
        return (f"pithtrain: precision: compute {dtype}, state {self.state} ({b['weights']} + {b['grads']} + "
                f"{b['optimizer']} B per parameter: weights, gradients, moments{copy}){gathers}")


# ---------------------------------------------------------------------------------------------
# The lean state: float32 masters as a bf16 high half (the parameter) and an int16 low half


class LeanState:
    """The lean state's pieces beside the parameters: each parameter's int16 low half (`lo`: with the
    parameter, the float32 master), and where a step has several micro-batches (`accumulate`) each
    parameter's float32 gradient buffer for the step.

    `convert(model)` turns float32 parameters into their bf16 high halves after the weights are set
    (build.build_run: drawn or train.init_from's, in float32) through nn.Module._apply, which keeps
    each Parameter object and which FSDP2 follows (it resets its sharded parameters from the new
    tensors). A post-accumulate-grad hook on every trainable parameter (FSDP2 calls it on
    the sharded ones after each reduce-scatter) adds the micro-batch's bf16 gradient into the float32
    buffer and drops it; kernels/wgrad.py writes into the buffer itself (`grad_into`). The buffers
    go at zero_grad (kernels/adamw.AdamW). Parameters are keyed by identity (and held: the run's)."""

    def __init__(self, accumulate: bool):
        self.accumulate = accumulate
        self._lo: dict[int, tuple] = {}  # id(p) -> (p, its int16 low half, shaped and placed as p)
        self._acc: dict[int, torch.Tensor] = {}  # id(p) -> its float32 gradient buffer this step

    @torch.no_grad()
    def convert(self, model: nn.Module) -> None:
        todo, lows = {id(p) for p in model.parameters()}, {}

        def halve(t):  # buffers (RoPE's tables stay float32) and converted tied parameters pass
            if id(t) not in todo or t.dtype != torch.float32:
                return t
            hi, lo = split(local(t))
            lows[id(t)] = placed_like(t, lo)
            return placed_like(t, hi)

        model._apply(halve)
        for p in model.parameters():
            if id(p) in lows:
                self._lo[id(p)] = (p, lows.pop(id(p)))
                if self.accumulate and p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._accumulate)

    def lo(self, p: torch.Tensor) -> torch.Tensor:
        return self._lo[id(p)][1]

    def named_lows(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Each converted parameter's low half by the parameter's name (checkpoint/dcp.py)."""
        return {n: e[1] for n, p in model.named_parameters() if (e := self._lo.get(id(p))) and e[0] is p}

    def _accumulate(self, p: torch.Tensor) -> None:
        g = p.grad
        if g is None:  # kernels/wgrad.py added this micro-batch's gradient into the buffer itself
            return
        buf = self._acc.get(id(p))
        if buf is None:
            self._acc[id(p)] = g.to(torch.float32)
        else:
            local(buf).add_(local(g))
        p.grad = None

    def grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """p's gradient this step: its float32 buffer, or its own .grad (one micro-batch)."""
        return self._acc.get(id(p), p.grad)

    def zero_grad(self) -> None:
        self._acc.clear()

    def master(self, w: torch.Tensor) -> None:
        """kernels/wgrad.py's question (WeightCopies.master): no other parameter owns w's gradient."""
        return None

    def grad_into(self, w: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
        """kernels/wgrad.py: w's float32 buffer to add this micro-batch's gradient into (buffer,
        False), made here on its first (buffer, True: write it, do not add)."""
        if id(w) not in self._lo:
            return None
        if (buf := self._acc.get(id(w))) is not None:
            return (buf, False) if type(buf) is torch.Tensor and buf.is_contiguous() else None
        buf = self._acc[id(w)] = torch.empty_like(w, dtype=torch.float32, memory_format=torch.contiguous_format)
        return buf, True


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
        b, src = self.copy_of(p), local(p)  # a DTensor master (experts): its local block
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

    def grad_into(self, w: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
        """kernels/wgrad.py: where copy w's gradient goes, its float32 master's .grad: (it, False) to
        add into; on the first micro-batch (made here empty, True): write it, do not add. None where
        w is no copy or the gradient cannot be written in place (autograd and `_into_master` then)."""
        p = self.master(w)
        if p is None:
            return None
        dtensor = isinstance(p, DTensor)  # experts FSDP leaves out: the master's local block is w's
        g = p.grad
        if g is None:
            if (type(p) is not nn.Parameter and not dtensor) or p.device != w.device:
                return None
            block = torch.empty_like(local(p), memory_format=torch.contiguous_format)
            p.grad = placed_like(p, block)
            return block, True
        g = local(g)
        return (g, False) if writable(g, w) else None

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
        master.grad = placed_like(master, b.grad.to(master.dtype))
    else:
        local(master.grad).add_(b.grad)
    b.grad = None
