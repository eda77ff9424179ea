"""Sharded training checkpoints with torch.distributed.checkpoint (DCP): atomic commit, verified
load, exact resume, resharding between parallel layouts.

    ckpt = Checkpointer(cfg, model, optimizer, scheduler, device)   # every rank
    start = ckpt.resume(True)        # True: latest valid in run_dir; False: fresh; "PATH": that one
    for step in range(start, steps):
        ...
        ckpt.after_step(step + 1)    # saves when due (checkpoint.every, and the last step if final)
    ckpt.close()                     # waits for an asynchronous save still in flight

Layout of `<log.run_dir>/checkpoints/`:

    step_20/              one committed checkpoint (20 optimizer steps done; data position = 20)
      .metadata           DCP's index (which chunk of which tensor lies where)
      __R_I.distcp        tensor data, written by rank R: model, optimizer moments, RNG states
      trainer.json        step, LR-scheduler state, optimizer hyper-parameters, world size, what
                          the token ids mean ("data": the shards' tokenizer fingerprint, EOS, vocabulary),
                          the training state ("state": train.state, float32 when absent)
      recipe.yaml         the whole recipe of the run (Config.to_yaml)
      tokenizer.json      the shards' tokenizer files (data.TOKENIZER_FILES; none for stdlib bytes), so
                          sample and export need no data directory
      manifest.json       size and sha256 of every file above; written last, before the rename
    latest                "step_20": the pointer, replaced (write tmp, fsync, os.replace) last
    .tmp-step_30/         a save in progress (or one that died); never loaded

Commit protocol: every rank, once its shards are written, hashes (sha256) and fsyncs the files
it wrote (its `__R_*.distcp`; rank 0 also the index, trainer and recipe) into
`.hashes-rankR.json`, all ranks at once (hash_own_files). Then rank 0 reads back the DCP index,
checks every file it names exists, merges the ranks' hashes into manifest.json (every file of the
directory must be in it), fsyncs the directory, renames `.tmp-step_N` -> `step_N`, fsyncs the
parent, then replaces `latest`, then prunes to `checkpoint.keep_last`. A crash at any point leaves
the previous checkpoint untouched: before the rename there is only a .tmp directory, after it a
complete, verified one. Resume verifies the same way: rank 0 names each candidate, every rank
hashes a share of its files (largest first, dealt round robin), and the first damaged file any
rank finds is named on all.

Resume policy (decided here, printed every time, never silent): candidates are the `step_N`
directories, newest first (`latest` is written last and normally names the newest; a newer
directory than `latest` means the process died between the rename and the pointer update, and
that directory is complete, so it is used). Each candidate's manifest is verified (sizes, then
sha256); a damaged one is reported with the file and the reason and the next older one is tried.
After a resume from step S, checkpoints of this run dir newer than S (damaged ones, or a
timeline abandoned by `--resume=PATH` / `--no-resume`) are renamed `.abandoned-step_N` so that a
later automatic resume cannot jump back to them; `.tmp-*` leftovers are deleted. A second save of
a step renames the old step_N `.replaced-step_N` before its own rename takes the name: a death in
between leaves no step_N, so resume renames `.replaced-step_N` back first (it was committed whole,
and is verified like any other) and says so. If checkpoints
exist but none is valid, resume stops with an error listing each problem. Every refusal names the
way out first (FRESH: --no-resume or another log.run_dir).

Safety: only tensors go through DCP (its non-tensor values are unpickled with weights_only=False,
so none are written and a checkpoint whose index declares one is refused); hyper-parameters and
the scheduler state are JSON; DCP's `.metadata` pickle is read with an unpickler that allows an
exact list of (module, name) pairs (DCP's metadata dataclasses, torch.Size, dtypes; no whole module,
no dotted name), and the data files it names must lie in the checkpoint directory. Tensor data
itself is read by DCP with torch.load(weights_only=True). The manifest's hashes catch damage, not
tampering: whoever can write a checkpoint can rewrite its manifest.

Saving is asynchronous (dcp.async_save: state staged to CPU memory, written by a thread) when
checkpoint.async_save is set and the run is on CUDA; the commit then runs in a thread on rank 0
once the write is done. DCP's exchanges for it run on that thread over a gloo group of their own
(`save_pg`), never the one the main thread's step boundary uses (`pg`), and the next optimizer
step waits for the staging copy. On CPU saving is synchronous. Multi-process runs need a file system
shared by all ranks (each rank writes its own shards into the same directory).

Training states (precision.py). A float32 checkpoint holds the float32 masters as `model.*` and
float32 moments; a lean one the parameters (the masters' bf16 high halves) as `model.*`, their int16
low halves as `lean.*`, bf16 moments. Either resumes either (`_conversion`): the masters' values are
the same (into a lean run: each float32 master read into host memory and split, kernels/adamw.
split; into a float32 run: the high half read into the float32 parameter, exact, and the low half
added to its bits, kernels/adamw.join_), the moments cast on read (DCP reads into the
live tensors' dtype). Export and load_model_weights join a lean checkpoint's halves.

Test hook (the only one): PITHTRAIN_TEST_CRASH_IN_SAVE=N makes the process os._exit(70) while
saving step N, after the shards are written and before the manifest and rename.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from pithtrain.config import field_default
from pithtrain.data import TOKENIZER_FILES, tokenizer_of
from pithtrain.kernels.adamw import join_, split
from pithtrain.models.common import local, placed_like

FORMAT = 1
MANIFEST, TRAINER, RECIPE, LATEST = "manifest.json", "trainer.json", "recipe.yaml", "latest"
CRASH_HOOK = "PITHTRAIN_TEST_CRASH_IN_SAVE"
# Model fields a resumed run may change (from the resumed step on): the balancing loss and bias
# update, the z-loss, the initialisation's std. Neither the parameters nor the forward depend on them.
TRAINING_ONLY = ("aux_loss_coeff", "bias_update_rate", "z_loss_coeff", "init_std")
# The way out of every resume refusal, named before any other.
FRESH = "start fresh with --no-resume (it sets the checkpoints aside) or choose another log.run_dir"


# Recipe fields added since checkpoints were first saved, with the behaviour a checkpoint saved
# before them had: a resumed run that differs says so ("recipe differs ...: data.sampler: 'random' -> 'epochs'").
BEFORE_FIELD = {"data.sampler": "random"}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the directory or file and why."""


# ---------------------------------------------------------------------------------------------
# Paths


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_of(path: Path) -> int | None:
    m = re.fullmatch(r"step_(\d+)", path.name)
    return int(m[1]) if m else None


def step_dirs(root: Path) -> list[Path]:
    """Committed checkpoint directories, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of, reverse=True)


REPLACED = re.compile(r"\.replaced-step_(\d+)(?:-\d+)?")


def replaced_dirs(root: Path) -> list[tuple[int, Path]]:
    """(N, `.replaced-step_N`): the previous save of step N, which a second save of that step set
    aside just before its own rename (Checkpointer._commit); left only by a death between the two."""
    found = [(int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else ())
             if p.is_dir() and (m := REPLACED.fullmatch(p.name))]
    return sorted(found, key=lambda x: (x[0], x[1].name))


def resolve(path: str | Path, check=None) -> Path:
    """A checkpoint directory from what a user may pass: a step dir, a checkpoints dir or a run dir
    (the last two: the newest valid checkpoint in it, skipped ones printed). `check` verifies one
    (Checkpointer._verify: every rank hashes a share)."""
    path, check = Path(path), check or verify
    if not path.exists():
        raise CheckpointError(f"{path}: does not exist")
    if (path / MANIFEST).is_file() or (path / ".metadata").is_file():
        check(path)
        return path
    root = path if step_dirs(path) else checkpoints_dir(path)
    found, notes = find_resumable(root, check)
    for n in notes:
        print(f"checkpoint: {n}", flush=True)
    if found is None:
        raise CheckpointError(f"{path}: no valid checkpoint here" + "".join(f"\n  {n}" for n in notes))
    return found


# ---------------------------------------------------------------------------------------------
# Manifest: per-file size + sha256, written at commit, checked on load


def _sha256(path: Path, sync: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
        if sync:  # at commit: every byte on disk before the rename makes the checkpoint visible
            os.fsync(f.fileno())
    return h.hexdigest()


def _fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, text: str):
    """Write tmp, fsync, os.replace: readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _progress(ckpt: Path, what: str, total: int, every_s: float = 10.0, quiet: bool = False):
    """`done(nbytes)` after each file: a line every `every_s` seconds while hashing, which takes
    minutes for a checkpoint of hundreds of GB (each rank hashes its share; rank 0 speaks)."""
    t0 = last = time.monotonic()
    seen = 0

    def done(nbytes: int):
        nonlocal last, seen
        seen += nbytes
        now = time.monotonic()
        if now - last >= every_s and seen < total and not quiet:
            last = now
            print(f"checkpoint: {what} {ckpt.name}: {seen / 1e9:.1f} of {total / 1e9:.1f} GB hashed "
                  f"({now - t0:.0f} s)", flush=True)
    return done


def own_files(ckpt: Path, rank: int) -> list[Path]:
    """The files rank `rank` wrote into a checkpoint: its DCP shards (`__R_*.distcp`, R its rank in
    the save's group, as FileSystemWriter names them); rank 0 also the index, trainer and recipe."""
    mine = sorted(ckpt.glob(f"__{rank}_*"))
    if rank == 0:  # named, not listed: other ranks' hash files appear meanwhile
        mine += [ckpt / n for n in (".metadata", TRAINER, RECIPE, *TOKENIZER_FILES) if (ckpt / n).is_file()]
    return mine


def hash_own_files(ckpt: Path, rank: int, world: int) -> None:
    """Each rank, after its shards are written: size + sha256 (and fsync) of its own files, into
    `.hashes-rank{R}.json`, which the commit merges into the manifest. Every rank hashes at once,
    so the time is that of one rank's share (~1/world of the checkpoint), not the whole."""
    files = own_files(ckpt, rank)
    sizes = {p.name: p.stat().st_size for p in files}
    done = _progress(ckpt, f"committing (rank {rank} of {world}, {len(files)} files)", sum(sizes.values()),
                     quiet=rank != 0)
    entries = {}
    for p in files:
        entries[p.name] = {"size": sizes[p.name], "sha256": _sha256(p, sync=True)}
        done(sizes[p.name])
    _write_durable(ckpt / f".hashes-rank{rank}.json", json.dumps(entries))


def write_manifest(ckpt: Path, step: int, world: int = 1, timeout_s: float = 3600.0):
    """Rank 0: merge every rank's `.hashes-rank{R}.json` (waiting for ranks still hashing, as an
    asynchronous save's do) into manifest.json; every file of the checkpoint must be in it."""
    parts, deadline = [ckpt / f".hashes-rank{r}.json" for r in range(world)], time.monotonic() + timeout_s
    while not all(p.is_file() for p in parts):
        if time.monotonic() > deadline:
            missing = [p.name for p in parts if not p.is_file()]
            raise CheckpointError(f"{ckpt}: ranks did not hash their files within {timeout_s:.0f} s ({missing})")
        time.sleep(0.05)
    entries = {name: e for p in parts for name, e in json.loads(p.read_text()).items()}
    files = {p.name for p in ckpt.iterdir() if p.is_file() and p.name != MANIFEST and p not in parts}
    if files != set(entries):
        raise CheckpointError(f"{ckpt}: files hashed by no rank: {sorted(files - set(entries))}")
    _write_durable(ckpt / MANIFEST, json.dumps({"format": FORMAT, "step": step, "files": entries}, indent=1))
    for p in parts:
        p.unlink()


def _share(files: dict, rank: int, world: int) -> list[str]:
    """This rank's files to hash at verification: largest first, dealt round robin (the same deal
    on every rank, from the manifest alone)."""
    return sorted(files, key=lambda n: (-files[n]["size"], n))[rank::world]


SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def _read_manifest(ckpt: Path) -> dict:
    """manifest.json, checked whole before any file is: `files` maps plain file names to a size
    (an int >= 0) and a sha256 (64 hex digits). Every rank reads the same file, so a malformed one
    is the same CheckpointError on each, never a KeyError on the rank whose share holds the bad entry."""
    mpath = ckpt / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{mpath}: missing: the checkpoint was never committed (incomplete save)")
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError as e:  # not JSON (a truncated file), or not UTF-8
        raise CheckpointError(f"{mpath}: malformed manifest (not JSON: {e})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"{mpath}: malformed manifest (no 'files' mapping)")
    for name, want in files.items():
        size, sha = (want.get("size"), want.get("sha256")) if isinstance(want, dict) else (None, None)
        why = ("not a file name of the checkpoint" if name in ("", ".", "..") or Path(name).name != name else
               "size is not a whole number of bytes" if type(size) is not int or size < 0 else
               "sha256 is not 64 hex digits" if not (isinstance(sha, str) and SHA256_HEX.fullmatch(sha)) else None)
        if why:
            raise CheckpointError(f"{mpath}: malformed manifest (entry {name[:100]!r}: {why})")
    return manifest


def verify(ckpt: Path, rank: int = 0, world: int = 1) -> dict:
    """Check every file against manifest.json (size first: a truncated file is named as such,
    then sha256); returns the manifest. With `world` > 1 this rank hashes its share only (the
    caller combines the ranks' verdicts: Checkpointer._verify). Files not in the manifest are
    printed, not loaded."""
    manifest = _read_manifest(ckpt)
    files = manifest["files"]
    for name, want in files.items():
        p = ckpt / name
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (listed in {MANIFEST})")
        size = p.stat().st_size
        if size != want["size"]:
            raise CheckpointError(f"{p}: truncated or overwritten: {size} bytes, manifest says {want['size']}")
    share = _share(files, rank, world)
    what = "verifying" if world == 1 else f"verifying (rank {rank} of {world})"
    done = _progress(ckpt, what, sum(files[n]["size"] for n in share), quiet=rank != 0)
    for name in share:
        if _sha256(ckpt / name) != files[name]["sha256"]:
            raise CheckpointError(f"{ckpt / name}: corrupt: sha256 does not match {MANIFEST}")
        done(files[name]["size"])
    extra = sorted(p.name for p in ckpt.iterdir() if p.name not in files and p.name != MANIFEST)
    if extra and rank == 0:
        print(f"checkpoint: {ckpt}: ignoring files not in the manifest: {', '.join(extra)}", flush=True)
    return manifest


def read_latest(root: Path) -> tuple[str | None, str | None]:
    """(the step_N name `latest` holds, or None; a note when it is there but damaged). Only a
    regular file holding one step_N name counts: a link, a directory, binary or other text is
    ignored out loud (and never printed: a link may point at any file)."""
    path = root / LATEST
    if not os.path.lexists(path):
        return None, None
    why = ("a symbolic link" if path.is_symlink() else None if path.is_file() else "not a regular file")
    if why is None:
        with open(path, "rb") as f:
            text = f.read(64).strip()
        name = text.decode("ascii", "replace")
        if step_of(Path(name)) is not None and name == Path(name).name:
            return name, None
        why = "not a step_N name"
    return None, f"ignoring {path} ({why}); choosing the newest valid checkpoint"


def find_resumable(root: Path, check=verify) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under `root` that verifies (`check`), and one note per thing skipped or odd."""
    pointer, note = read_latest(root)
    notes = [note] if note else []
    for tmp in sorted(root.glob(".tmp-step_*")) if root.is_dir() else []:
        notes.append(f"ignoring {tmp.name}: a save that did not finish")
    candidates = step_dirs(root)
    if candidates and note is None and pointer != candidates[0].name:
        notes.append(f"{LATEST} names {pointer!r} but {candidates[0].name} is newer "
                     "(the process stopped between commit and pointer update); trying the newest first")
    for c in candidates:
        try:
            check(c)
            return c, notes
        except CheckpointError as e:
            notes.append(f"skipping {c.name}: {e}")
    return None, notes


# ---------------------------------------------------------------------------------------------
# Reading DCP's .metadata (a pickle) without unpickling arbitrary objects


_DCP_MD = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """Exact (module, name) pairs: DCP's metadata dataclasses, torch.Size, dtypes, layouts. No
    module is allowed as a whole: protocol 4 resolves dotted names through a module's imports
    (`metadata` + `os.system`), so anything looser reaches a callable."""
    ALLOWED = {(_DCP_MD, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                       "TensorStorageMetadata", "BytesStorageMetadata",
                                       "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
        ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
        ("pathlib._local", "PosixPath"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict")} | {
        ("torch", n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unsafe: it names {module}.{name}, which is not one of DCP's "
                                     "metadata classes (refusing to unpickle it: a crafted index can run code)")


class SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                md = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"{path}: {e}") from None
        except Exception as e:  # truncated or garbage bytes fail in many ways inside pickle
            raise CheckpointError(f"{path}: not a readable DCP index ({type(e).__name__}: {e})") from None
        if not isinstance(md, Metadata):
            raise CheckpointError(f"{path}: not a DCP index (it holds a {type(md).__name__})")
        return md


def check_index(ckpt: Path, keys) -> None:
    """Every requested key is a tensor in the index (a non-tensor would go through
    torch.load(weights_only=False)), and every file the index points to exists."""
    md = SafeReader(ckpt).read_metadata()
    for k in keys:
        m = md.state_dict_metadata.get(k)
        if m is None:
            raise CheckpointError(f"{ckpt}: has no tensor {k!r} (saved from a different model?)")
        if not isinstance(m, TensorStorageMetadata):
            raise CheckpointError(f"{ckpt}: {k!r} is not a tensor; refusing to unpickle it")
    for info in (md.storage_data or {}).values():
        if not isinstance(info.relative_path, str) or Path(info.relative_path).name != info.relative_path:
            raise CheckpointError(f"{ckpt}/.metadata: unsafe: names a data file outside the checkpoint "
                                  f"({info.relative_path!r})")
        if not (ckpt / info.relative_path).is_file():
            raise CheckpointError(f"{ckpt / info.relative_path}: missing (named in .metadata)")


def _flat_keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += _flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out


# ---------------------------------------------------------------------------------------------
# Distributed helpers (all degrade to no-ops in one process)


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _world() -> int:
    return dist.get_world_size() if _dist() else 1


def agree(group, where: Path, check, *args):
    """`check(*args)` on every rank of `group` (None: the default group); the first error any rank
    met is raised on all as a CheckpointError (naming `where` unless it is one already). A rank
    that left alone would leave the others waiting in their next collective until the timeout."""
    error, result = None, None
    try:
        result = check(*args)
    except Exception as e:  # every rank must reach the all_gather
        error = str(e) if isinstance(e, CheckpointError) else f"{where}: {type(e).__name__}: {e}"
    if _dist():
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
        error = next((e for e in errors if e), None)
    if error:
        raise CheckpointError(error)
    return result


@contextlib.contextmanager
def no_dist_warnings():
    """DCP warns on every single-process save/load; one process is our intent (no_dist), so hush it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


# ---------------------------------------------------------------------------------------------
# The checkpointer


class Checkpointer:
    """Saves and restores everything a run needs to continue exactly: model, optimizer moments and
    hyper-parameters, LR schedule, step (= data position: batches are a function of the step),
    RNG states, and the recipe. All ranks construct it and call every method."""

    def __init__(self, cfg, model, optimizer, scheduler, device: torch.device, precision=None):
        self.cfg, self.model, self.optimizer, self.scheduler = cfg, model, optimizer, scheduler
        self.device = device
        self.state = precision.state if precision is not None else "float32"  # the run's (precision.py)
        self.lean = precision.lean if precision is not None else None
        self.root = checkpoints_dir(cfg.log.run_dir)
        self.rank = dist.get_rank() if _dist() else 0
        self.use_async = cfg.checkpoint.async_save and device.type == "cuda"
        # Collectives on one group pair up in the order each rank issues them, so no group is used
        # by two threads: `pg` (gloo: no NCCL communicator shared with training) serves the main
        # thread (train.py's step boundary, our barriers, broadcasts, verification, loading, a
        # synchronous save); an asynchronous save's plan and write-result exchanges, which DCP runs
        # on its background thread while the main thread trains, go over `save_pg`, made at the first
        # asynchronous save (every rank saves the same steps).
        self.pg = dist.new_group(backend="gloo") if _dist() else None
        self.save_pg = None
        self._pending = None  # (future, thread) of an async save in flight
        self._staging = None  # an async save's copy of the state to CPU, when its stager copies in the background
        optimizer.register_step_pre_hook(self._staged)  # that copy is complete before the weights change
        self._error: list[BaseException] = []
        self.saved_at = time.monotonic()  # when the last save began (checkpoint.every_minutes)

    def say(self, msg: str):
        if self.rank == 0:
            print(f"checkpoint: {msg}", flush=True)

    def _barrier(self):
        if self.pg is not None:
            dist.barrier(group=self.pg)

    def _bcast(self, obj):
        """Rank 0's value on every rank (in-memory between our own processes, not from disk)."""
        if self.pg is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    # --- state

    def _state(self, weights_only: bool = False):
        """(DCP state: tensors only, trainer state: JSON-able). weights_only: the model alone."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        rng = {f"rank{self.rank}.cpu": torch.get_rng_state()}  # per-rank RNG states as uint8 tensors, not pickles
        if self.device.type == "cuda":
            rng[f"rank{self.rank}.cuda"] = torch.cuda.get_rng_state(self.device)
        tensors = {"model": model_sd} if weights_only else {"model": model_sd, "optim": optim_sd["state"], "rng": rng}
        if self.lean is not None:
            tensors["lean"] = self.lean.named_lows(self.model)
        trainer = {"format": FORMAT, "world_size": _world(), "state": self.state,
                   "scheduler": self.scheduler.state_dict(),
                   "optimizer_param_groups": optim_sd["param_groups"],
                   "torch": torch.__version__}
        return tensors, trainer

    # --- save

    def after_step(self, step: int, now: bool = False):
        """Call once per optimizer step with the number of steps done; saves when due, or `now`
        (every rank agreed: a notice, checkpoint.every_minutes; train.py)."""
        c, last = self.cfg.checkpoint, step == self.cfg.train.steps
        if self._error:
            raise CheckpointError(f"asynchronous save failed: {self._error[0]}") from self._error[0]
        if now or (c.every and step % c.every == 0) or (last and c.final):
            try:
                self.save(step)
            except (Exception, CheckpointException) as e:  # DCP's own is a BaseException
                raise self._save_failed(step, e) from None

    def _save_failed(self, step: int, e: BaseException) -> CheckpointError:
        """A save that failed (a full disk, an I/O error) loses its partial directory: left in
        place it would keep the disk full, and every restart would fail at the same step."""
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> (error, trace)
        if failures:
            e = next(iter(failures.values()))[0]
        tmp = self.root / f".tmp-step_{step}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        return CheckpointError(f"saving step {step} failed ({reason}); removed the partial {tmp}; "
                               "the previous checkpoint is intact")

    def save(self, step: int):
        self.wait()  # one save in flight at a time; the previous commit is done before a new one
        self.saved_at = time.monotonic()
        tmp = self.root / f".tmp-step_{step}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a save that died
            tmp.mkdir(parents=True)
        self._barrier()
        weights_only = self.cfg.checkpoint.weights_only and step == self.cfg.train.steps
        tensors, trainer = self._state(weights_only)
        if self.rank == 0:
            trainer.update(step=step, weights_only=weights_only,
                           saved_at=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                           data=tokenizer_of(self.cfg.data))
            # the shards' tokenizer, else train.init_from's (the config checked it is the shards')
            dirs = (self.cfg.data.path, self.cfg.train.init_from) if self.cfg.data.source == "shards" else ()
            src = next((Path(d) for d in dirs if d and (Path(d) / "tokenizer.json").is_file()), None)
            for f in TOKENIZER_FILES if src else ():
                if (src / f).is_file():
                    shutil.copyfile(src / f, tmp / f)
            try:
                text = json.dumps(trainer, indent=1)
            except TypeError as e:
                raise CheckpointError(f"trainer state is not JSON-serialisable: {e}") from None
            (tmp / TRAINER).write_text(text)
            (tmp / RECIPE).write_text(self.cfg.to_yaml())
        writer = FileSystemWriter(tmp)  # sync_files=True: each shard is fsynced by its writer
        if self.use_async:
            if self.pg is not None and self.save_pg is None:
                self.save_pg = dist.new_group(backend="gloo")
            with no_dist_warnings():
                fut = dcp.async_save(tensors, storage_writer=writer, process_group=self.save_pg,
                                     no_dist=self.save_pg is None)
            # a stager that copies in the background answers (staging, upload) futures: the optimizer
            # step waits for the first (_staged); FileSystemWriter copies before returning
            self._staging = getattr(fut, "staging_completion", None)
            fut = getattr(fut, "upload_completion", fut)
            # every rank hashes its files once written; rank 0's future ends after every rank's
            # write results are in, and its commit waits for the other ranks' hashes
            thread = threading.Thread(target=self._finish_async, args=(fut, tmp, step), daemon=True)
            thread.start()
            self._pending = (fut, thread)
        else:
            with no_dist_warnings():
                dcp.save(tensors, storage_writer=writer, process_group=self.pg, no_dist=self.pg is None)
            hash_own_files(tmp, self.rank, _world())  # every rank its own files, at the same time
            self._barrier()
            if self.rank == 0:
                self._commit(tmp, step)
            self._barrier()

    def _finish_async(self, fut, tmp: Path, step: int):
        try:
            fut.result()
            hash_own_files(tmp, self.rank, _world())
            if self.rank == 0:
                self._commit(tmp, step)
        except BaseException as e:  # re-raised on the training thread by wait()/after_step()
            shutil.rmtree(tmp, ignore_errors=True)  # a partial save keeps its space (_save_failed)
            self._error.append(e)

    def _staged(self, *_):
        """Optimizer step pre-hook: an asynchronous save's copy of the state is complete."""
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.result()

    def _join(self):
        """The asynchronous save in flight, no longer pending: its write, then its commit thread."""
        fut, thread = self._pending
        self._pending = None
        fut.result()
        thread.join()

    def wait(self):
        """Block until an asynchronous save in flight is written and committed."""
        if self._pending is None:
            return
        self._join()
        if self._error:
            raise CheckpointError(f"asynchronous save failed: {self._error[0]}") from self._error[0]
        self._barrier()

    close = wait

    def abort(self):
        """The run is failing. In one process an asynchronous save still in flight is finished and
        committed: its state is that of a completed step, and the daemon commit thread would die with
        the process. Across ranks it is left: waiting could block on a rank that is gone, and the next
        resume takes the newest committed checkpoint."""
        if self._pending is None or self.pg is not None:
            return
        try:
            self._join()
        except BaseException as e:  # the run's own error is the one to report
            self.say(f"the save in flight failed as well: {e}")

    def _commit(self, tmp: Path, step: int):
        if os.environ.get(CRASH_HOOK) == str(step):
            os._exit(70)  # test hook: die with the shards written and nothing committed
        check_index(tmp, [])  # the index reads back and every shard it names exists
        write_manifest(tmp, step, _world())  # every rank's hashes, merged
        _fsync_dir(tmp)
        final = self.root / f"step_{step}"
        # a second save of the same step: keep the old one until the new is in place
        old = self._set_aside(final, "replaced") if final.exists() else None
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(self.root)
        _write_durable(self.root / LATEST, final.name + "\n")
        for old in step_dirs(self.root)[self.cfg.checkpoint.keep_last:]:
            shutil.rmtree(old)
        self.say(f"saved step {step} -> {final}")

    def _set_aside(self, path: Path, why: str) -> Path:
        dest, k = self.root / f".{why}-{path.name}", 1
        while dest.exists():
            dest, k = self.root / f".{why}-{path.name}-{k}", k + 1
        os.rename(path, dest)
        return dest

    # --- resume

    def resume(self, resume: bool | str = True) -> int:
        """Restore the run's state and return the number of steps already done (0: fresh).
        True: the newest valid checkpoint in run_dir if any; False: fresh; a path: exactly that."""
        found, error = None, None
        if self.rank == 0:
            try:
                found = self._choose(resume)
            except Exception as e:  # every rank must learn of it, or the others wait forever
                error = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            finally:
                self._bcast(None)  # no more checkpoints to verify
        else:  # rank 0 decides; every rank hashes a share of each candidate it names
            while (candidate := self._bcast(None)) is not None:
                with contextlib.suppress(CheckpointError):
                    self._verify(Path(candidate))
        found, error = self._bcast((str(found) if found else None, error))
        if error:
            raise CheckpointError(error)
        step = self.load(Path(found)) if found else 0
        agree(self.pg, self.root, lambda: self._tidy(step) if self.rank == 0 else None)
        if found:
            self.say(f"resumed from {found} at step {step} (data position {step})")
        if found and step >= self.cfg.train.steps:
            self.say(f"nothing left to train: train.steps is {self.cfg.train.steps} (raise it to continue)")
        return step

    def _verify_from_rank0(self, ckpt: Path):
        self._bcast(str(ckpt))  # the other ranks, waiting in resume(), verify it with rank 0
        self._verify(ckpt)

    def _verify(self, ckpt: Path):
        """Every rank hashes its share of `ckpt` at once; the first problem any rank found is
        raised on every rank (it names the file)."""
        agree(self.pg, ckpt, verify, ckpt, self.rank, _world())

    def _choose(self, resume) -> Path | None:
        if resume is False:
            if step_dirs(self.root):
                self.say(f"--no-resume: starting fresh; existing checkpoints in {self.root} are set aside")
            return None
        check = self._verify_from_rank0
        if resume is not True:
            return resolve(resume, check)  # exactly what was asked for: a damaged one is an error
        self._settle_replaced(None)  # a step_N that died being saved again: its previous save is a candidate
        found, notes = find_resumable(self.root, check)
        for n in notes:
            self.say(n)
        if found is None and step_dirs(self.root):
            raise CheckpointError(f"{self.root}: checkpoints exist but none is valid ({FRESH}):"
                                  + "".join(f"\n  {n}" for n in notes))
        if found is None:
            self.say(f"no checkpoint in {self.root}; starting fresh")
        return found

    def _settle_replaced(self, step: int | None):
        """Each `.replaced-step_N` (replaced_dirs): renamed back to step_N when there is none (it was
        committed whole; verification then takes or skips it like any step_N); once the resume
        point `step` is chosen, set aside as abandoned when newer, removed when step_N exists."""
        for n, p in replaced_dirs(self.root):
            final = self.root / f"step_{n}"
            if step is not None and n > step:
                self.say(f"set aside {p.name} -> {self._set_aside(p, 'abandoned').name} "
                         f"(newer than the resume point, step {step})")
            elif not final.exists():
                os.rename(p, final)
                _fsync_dir(self.root)
                self.say(f"restored {p.name} -> {final.name}: the process stopped while step {n} was saved "
                         "again, and this is its previous save")
            elif step is not None:
                shutil.rmtree(p)
                self.say(f"removed {p.name} (step_{n} replaced it)")

    def _tidy(self, step: int):
        """Set aside this run dir's checkpoints newer than the resume point, drop .tmp leftovers."""
        for p in step_dirs(self.root):
            if step_of(p) > step:
                dest = self._set_aside(p, "abandoned")
                self.say(f"set aside {p.name} -> {dest.name} (newer than the resume point, step {step})")
        self._settle_replaced(step)
        for tmp in self.root.glob(".tmp-step_*") if self.root.is_dir() else []:
            shutil.rmtree(tmp, ignore_errors=True)
            self.say(f"removed {tmp.name} (a save that did not finish)")
        # `latest` names the newest checkpoint left, so a later resume is not told of a gap
        kept, pointer = step_dirs(self.root), self.root / LATEST
        if pointer.is_dir() and not pointer.is_symlink():  # os.replace cannot write over it
            self.say(f"set aside the directory {LATEST} -> {self._set_aside(pointer, 'damaged').name}")
        if kept and read_latest(self.root)[0] != kept[0].name:
            _write_durable(pointer, kept[0].name + "\n")
        elif not kept and os.path.lexists(pointer):
            pointer.unlink()

    def load(self, ckpt: Path) -> int:
        """Load a verified checkpoint into model, optimizer, scheduler and RNG; returns its step.
        Works across parallel layouts: DCP reads the chunks each rank's (D)Tensors need."""
        tensors, _ = self._state()  # current (sharded) tensors: DCP loads into them in place
        live = dict(tensors["model"])
        # all ranks enter DCP's load, or none
        trainer, convert = agree(self.pg, ckpt, self._loadable, ckpt, tensors)
        with no_dist_warnings():
            dcp.load(tensors, storage_reader=SafeReader(ckpt), process_group=self.pg, no_dist=self.pg is None)
        convert(tensors)
        tensors["model"] = live
        groups, schedule = self._recipe_hyperparameters(trainer)
        set_state_dict(self.model, self.optimizer, model_state_dict=tensors["model"],
                       optim_state_dict={"state": tensors["optim"], "param_groups": groups})
        self.scheduler.load_state_dict(schedule)
        rng = tensors["rng"]
        if f"rank{self.rank}.cpu" in rng:
            torch.set_rng_state(rng[f"rank{self.rank}.cpu"])
        if f"rank{self.rank}.cuda" in rng:
            torch.cuda.set_rng_state(rng[f"rank{self.rank}.cuda"], self.device)
        return int(trainer["step"])

    def _loadable(self, ckpt: Path, tensors: dict) -> dict:
        """The checks before DCP's load, on every rank (agree): the checkpoint can
        resume a run, holds this model, and every tensor this rank needs; returns trainer.json.
        Drops the RNG states the checkpoint lacks from `tensors`."""
        trainer = json.loads((ckpt / TRAINER).read_text())
        if trainer.get("weights_only"):
            raise CheckpointError(f"{ckpt}: saved with checkpoint.weights_only (the model alone, no optimizer "
                                  f"state), so it cannot resume a run: {FRESH}; or export it (python -m "
                                  "pithtrain.checkpoint.export) and train from it with train.init_from")
        self._compare_recipe(ckpt)  # before the tokenizer: a different model is the refusal that holds
        self._check_tokenizer(ckpt, trainer.get("data"))
        md_keys = SafeReader(ckpt).read_metadata().state_dict_metadata
        rng = tensors["rng"]
        for k in [k for k in rng if f"rng.{k}" not in md_keys]:
            del rng[k]  # saved with fewer ranks, or on CPU: this rank keeps its seeded RNG state
        if trainer["world_size"] != _world():
            self.say(f"saved with {trainer['world_size']} ranks, loading into {_world()} (resharded); "
                     "ranks without a saved RNG state keep their seeded one")
        convert = self._conversion(trainer.get("state", "float32"), tensors)
        check_index(ckpt, _flat_keys(tensors))
        return trainer, convert

    def _conversion(self, saved: str, tensors: dict):
        """A checkpoint of the other training state (module docstring): the load targets that read it
        (in `tensors`, in place) and the function that completes the conversion after DCP's load.
        Host memory: this rank's share of the masters in float32 (into lean) or of the low halves."""
        if saved == self.state:
            return lambda tensors: None
        if (saved, self.state) not in (("float32", "lean"), ("lean", "float32")):
            raise CheckpointError(f"a {saved!r} training state does not resume as train.state={self.state!r}")
        self.say(f"the checkpoint holds the {saved} training state, this run trains the {self.state} one: "
                 "the masters' values carry over exactly, the moments are cast")
        live = dict(tensors["model"])  # what set_state_dict then loads into the parameters
        if saved == "float32":  # the float32 masters into host memory, split into the lean halves afterwards
            lows = tensors.pop("lean")  # none in the checkpoint
            for name in lows:
                tensors["model"][name] = _host_like(live[name], torch.float32)

            def finish(tensors):
                for name, lo in lows.items():
                    for dst, src in zip((live[name], lo), split(local(tensors["model"][name]).to(self.device))):
                        local(dst).copy_(src)
            return finish
        lows = {name: _host_like(p, torch.int16) for name, p in self.model.named_parameters()}
        tensors["lean"] = lows  # read beside the high halves, into the float32 tensors

        def finish(tensors):
            for name, lo in lows.items():
                join_(local(tensors["model"][name]).detach(), local(lo))
        return finish

    def _recipe_hyperparameters(self, trainer: dict) -> tuple[list[dict], dict]:
        """Optimizer param groups and scheduler state to load: the saved step counts with the
        recipe's hyper-parameters (the recipe is the whole truth of a run, so a changed lr, weight
        decay, betas or eps applies from the resumed step on, as `_compare_recipe` says). Each
        group's lr is where the recipe's schedule stands at the saved step, computed as LambdaLR
        does, so an unchanged recipe resumes bit-identically. Groups are this rank's own
        parameter names (a pipeline stage holds only its layers)."""
        live = get_state_dict(self.model, self.optimizer)[1]["param_groups"]
        saved = trainer["optimizer_param_groups"]
        if len(live) != len(saved):
            raise CheckpointError(f"optimizer has {len(live)} parameter groups, checkpoint {len(saved)}")
        schedule = dict(trainer["scheduler"])
        schedule["base_lrs"] = [g["initial_lr"] for g in live]
        saved_lr = schedule["_last_lr"][0]
        schedule["_last_lr"] = [base * fn(schedule["last_epoch"])
                                for base, fn in zip(schedule["base_lrs"], self.scheduler.lr_lambdas)]
        if not math.isclose(saved_lr, schedule["_last_lr"][0], rel_tol=1e-9):  # e.g. a longer cosine
            t = self.cfg.train
            self.say(f"the LR at step {schedule['last_epoch']} is {schedule['_last_lr'][0]:.3e}, not the checkpoint's "
                     f"{saved_lr:.3e}: train.lr_schedule {t.lr_schedule} over train.steps {t.steps} applies from here")
        groups = [{**cur, "lr": lr} for cur, lr in zip(live, schedule["_last_lr"])]
        return groups, schedule

    def _check_tokenizer(self, ckpt: Path, saved: dict | None):
        """Token ids mean what they meant when the checkpoint was saved, unless the recipe allows a
        change (data.allow_tokenizer_change). Checkpoints older than the record are not checked."""
        now = tokenizer_of(self.cfg.data)
        if saved is None or saved.get("tokenizer_sha256") == now["tokenizer_sha256"]:
            return
        what = (f"{saved.get('tokenizer')} (sha256 {str(saved.get('tokenizer_sha256'))[:12]})",
                f"{now['tokenizer']} (sha256 {str(now['tokenizer_sha256'])[:12]})")
        if not self.cfg.data.allow_tokenizer_change:
            raise CheckpointError(f"{ckpt}: trained on ids of tokenizer {what[0]}; the data now is "
                                  f"{self.cfg.data.path or 'stdlib'}, of {what[1]}: its ids mean other tokens. "
                                  f"To train on this data, {FRESH}; or resume onto data of the checkpoint's "
                                  "tokenizer (data.allow_tokenizer_change=true continues on these ids anyway)")
        self.say(f"tokenizer changed from {what[0]} to {what[1]} (data.allow_tokenizer_change)")

    def _compare_recipe(self, ckpt: Path):
        """A different model cannot load; other recipe changes are allowed and printed, model
        fields that only shape the loss, the balancing update or the initialisation (TRAINING_ONLY)
        among them. A model field the saved recipe lacks (added to the family since) reads as its
        default."""
        saved = yaml.safe_load((ckpt / RECIPE).read_text())
        now = self.cfg.to_dict()
        saved["model"] = saved_model = saved.get("model") or {}
        added = {f.name: field_default(f) for f in dataclasses.fields(self.cfg.model)
                 if f.name in now["model"] and f.name not in saved_model}
        if added:
            saved_model.update(added)
            self.say(f"{ckpt} was saved before these model fields existed; read as their defaults: "
                     + ", ".join(f"{k}={v!r}" for k, v in added.items()))
        for key, then in BEFORE_FIELD.items():  # what a checkpoint saved before the field existed ran with
            s, k = key.split(".")
            saved.setdefault(s, {}).setdefault(k, then)
        diffs = [(f"{s}.{k}", (saved.get(s) or {}).get(k), v) for s in now for k, v in now[s].items()
                 if (saved.get(s) or {}).get(k) != v]
        model = [d for d in diffs if d[0].startswith("model.") and d[0][6:] not in TRAINING_ONLY]
        if model:
            raise CheckpointError(f"{ckpt}: saved with a different model: " + "; ".join(
                f"{k}: {a!r} in the checkpoint, {b!r} now" for k, a, b in model)
                + f". To train this model, {FRESH}; or resume with the checkpoint's recipe.yaml")
        if diffs:
            self.say("recipe differs from the checkpoint's (the current one is used): " + "; ".join(
                f"{k}: {a!r} -> {b!r}" for k, a, b in diffs))


# ---------------------------------------------------------------------------------------------
# Loading the weights alone (export, evaluation)


def load_model_weights(ckpt: Path, model: torch.nn.Module) -> None:
    """Load a verified checkpoint's model tensors into a single-process float32 model (a lean
    checkpoint's masters joined from their halves)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    sd = {"model": get_model_state_dict(model)}
    if lean_checkpoint(ckpt):
        sd["lean"] = {name: torch.empty_like(p, dtype=torch.int16) for name, p in model.named_parameters()}
    read_tensors(ckpt, sd)
    set_model_state_dict(model, sd["model"])
    params = dict(model.named_parameters())
    for name, lo in sd.get("lean", {}).items():
        join_(params[name].detach(), lo)


def read_tensors(ckpt: Path, sd: dict, checked: bool = False) -> None:
    """Read a checkpoint's tensors into `sd` (nested dicts of tensors, in place) in one process,
    the index checked first (check_index) unless the caller has."""
    if not checked:
        check_index(ckpt, _flat_keys(sd))
    with no_dist_warnings():
        dcp.load(sd, storage_reader=SafeReader(ckpt), no_dist=True)


def lean_checkpoint(ckpt: Path) -> bool:
    """Whether `ckpt` holds the lean training state (its masters as `model.*` + `lean.*`)."""
    return json.loads((ckpt / TRAINER).read_text()).get("state") == "lean"


def _host_like(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty host tensor of p's local shape in `dtype`, a DTensor placed as p where p is one (a load
    target DCP reads this rank's chunks into)."""
    return placed_like(p, torch.empty(local(p).shape, dtype=dtype))


# ---------------------------------------------------------------------------------------------
# Disk: what the run's checkpoints will take, said at start-up


def disk_estimate(cfg, n_params: int) -> str | None:
    """A line for the start-up log: bytes per save (float32 weights and AdamW's two moments: 12
    bytes a parameter; train.state=lean: bf16 halves and moments, 8), the peak on disk under the
    save policy (keep_last committed saves + the one being written in .tmp, as many as the run
    makes: checkpoint.every's, checkpoint.every_minutes' -- the clock's, up to one a step -- and the
    final one; + the final export), and the free space of log.run_dir's filesystem, with a warning
    when less. An asynchronous save (on CUDA) first copies
    the state to host memory: said too. None when the run saves nothing."""
    c, steps = cfg.checkpoint, cfg.train.steps
    saves = steps if c.every_minutes else (
        (steps // c.every if c.every else 0) + (1 if c.final and not (c.every and steps % c.every == 0) else 0))
    if saves == 0:
        return None
    lean = cfg.train.state == "lean"
    per_save = (8 if lean else 12) * n_params
    kept = min(c.keep_last, saves - 1) + 1
    peak = kept * per_save
    if c.export_hf:
        peak += n_params * (2 if c.export_dtype == "bfloat16" else 4)
    where = Path(cfg.log.run_dir).absolute()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    what = "lean masters (bf16 + int16) + bf16 moments" if lean else "float32 weights + AdamW moments"
    line = (f"checkpoint: {per_save / 1e9:.2f} GB per save ({what}), peak "
            f"{peak / 1e9:.2f} GB on disk ({kept} saves: keep_last={c.keep_last} and the one being written"
            f"{', and the export' if c.export_hf else ''}); {free / 1e9:.1f} GB free at {where}")
    if c.async_save and cfg.train.device != "cpu" and torch.cuda.is_available():  # Checkpointer.use_async
        line += f"; an asynchronous save first copies it to host memory ({per_save / 1e9:.2f} GB over the ranks)"
    if free < peak:
        line += (f"\nwarning: the run directory's filesystem has {free / 1e9:.1f} GB free, less than the "
                 f"{peak / 1e9:.2f} GB its checkpoints will take (lower checkpoint.keep_last or free space)")
    return line
