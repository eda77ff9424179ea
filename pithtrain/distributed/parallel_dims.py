"""The parallel layout of a run: one object built from the recipe's `parallel` section.

    dims = ParallelDims.from_config(cfg, world_size)   # validates; no collective has run yet
    dims.build_meshes("cuda")                            # after init_process_group
    dims.cp_enabled, dims.cp_group, dims.data_parallel_rank ...

Rank layout. The world is a row-major grid (pp, dp, fsdp, cp): pp outermost (a pipeline stage is
a contiguous block of ranks), cp innermost (its K/V all-gathers run every layer, so its ranks are
neighbours). world_size must equal pp * dp * fsdp * cp.

Expert parallelism borrows ranks; it is not a factor of the world size. Inside one pipeline stage
the dp * fsdp * cp ranks (row-major) are split as (edp, efsdp, ep) with ep innermost: either `ep`
divides `fsdp * cp` (efsdp = fsdp*cp/ep, edp = dp), or fsdp*cp divides ep and ep divides
dp*fsdp*cp, and ep then spans dp replicas too (efsdp = 1, edp = dp*fsdp*cp/ep; e.g. dp=2 ep=2):

    dense parameters   sharded over fsdp*cp  (FSDP), replicated over dp   -> dense_mesh (dp, fsdp_cp)
    routed experts     split by expert over ep, sharded over efsdp (FSDP, dim 1),
                       replicated over edp                                -> expert_mesh (edp, efsdp, ep)

Examples (world size in brackets): `fsdp=2 ep=2` [2] experts whole per rank, 4 of 8 each;
`fsdp=4 ep=2` [4] experts split 2 ways by expert and 2 ways by width; `dp=2 fsdp=2 ep=2` [4];
`cp=2 ep=2` [2] the two halves of each sequence route to each other's experts.

Batch rows. The dp * fsdp ranks (the data-parallel ranks: dp replicas times fsdp shards; `dp`
alone is the replicated dimension) each read their own rows of the global batch
(`data_parallel_rank` of `data_parallel_size`, see data.rows); the cp ranks of one data-parallel
rank share rows and split the sequence (context_parallel.py).

The meshes hold no pp dimension: each pipeline stage gets meshes over its own ranks (built on
every rank, in the same order, as new_group requires); the pipeline engine makes its own groups
for its sends and receives (pipeline.new_pp_groups).

One GPU on the FSDP path (`one_gpu_fsdp`, scripts/calibrate.py): world size 1 with FSDP2 and the
all-to-all dispatcher on one-rank meshes, so one GPU runs an FSDP layout's per-rank program
(its casts, gathers and reduce-scatters as copies): "experts_alone" leaves the experts out of FSDP
as each rank's own experts are (fsdp=8 ep=8), "experts_sharded" keeps them in (layouts that shard
or replicate them).

API for other engines (pipeline, checkpoint, the performance model): `from_config` (checks only),
`init(device)` (process group + meshes), `close()`; flags `*_enabled`, `distributed`,
`experts_alone`, `ep_dispatch`; sizes `efsdp`, `edp`; coordinates `coords`, `pp_rank`, `cp_rank`,
`ep_rank`, `data_parallel_rank`, `data_parallel_size` (pure arithmetic on `rank`); after `init`:
`stage_mesh`, `dense_mesh`, `expert_mesh`, and groups `cp_group`, `ep_group`, `stage_group` (all
ranks of this stage).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from pithtrain.config import ConfigError
from pithtrain.distributed.schedule import num_virtual_stages, split_layers


@dataclass
class ParallelDims:
    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    cp: int = 1
    ep: int = 1
    world_size: int = 1
    rank: int = 0
    one_gpu_fsdp: str = ""  # "", "experts_alone" or "experts_sharded": the module docstring

    # --- validation (pure arithmetic: runs before init_process_group, identically on every rank)

    @classmethod
    def from_config(cls, cfg, world_size: int | None = None, rank: int | None = None) -> "ParallelDims":
        """Read the layout from `cfg.parallel` and check it against the world size (default:
        torchrun's WORLD_SIZE), the model and the sequence length. Raises ConfigError."""
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        p = cfg.parallel
        unset = [k for k in ("pp", "dp", "fsdp", "cp", "ep") if getattr(p, k) is None]
        if unset:
            raise ConfigError(f"{cfg.source}: parallel: auto left {', '.join(unset)} unset; "
                              "pithtrain.plan.auto_layout chooses them before the layout is built")
        dims = cls(pp=p.pp, dp=p.dp, fsdp=p.fsdp, cp=p.cp, ep=p.ep, world_size=world_size, rank=rank)
        dims.validate(cfg)
        return dims

    def validate(self, cfg):
        src, m, t = cfg.source, cfg.model, cfg.train

        def fail(key, msg):
            raise ConfigError(f"{src}: {key}: {msg}")

        product = self.pp * self.dp * self.fsdp * self.cp
        if product != self.world_size:
            fail("parallel", f"pp*dp*fsdp*cp = {self.pp}*{self.dp}*{self.fsdp}*{self.cp} = {product} "
                             f"but {self.world_size} processes were started (torchrun "
                             f"--nproc-per-node); ep borrows ranks from fsdp*cp and is not a factor")
        if self.ep > 1:
            experts = getattr(m, "num_experts", None)
            if experts is None:
                fail("parallel.ep", f"model family {m.family!r} has no routed experts")
            if experts % self.ep:
                fail("parallel.ep", f"{self.ep} does not divide model.num_experts ({experts})")
            shard, stage = self.fsdp * self.cp, self.dp * self.fsdp * self.cp
            if shard % self.ep and (self.ep % shard or stage % self.ep):
                fail("parallel.ep", f"{self.ep} must divide fsdp*cp = {shard}, or be a multiple of it "
                                    f"that divides dp*fsdp*cp = {stage}: expert parallelism borrows "
                                    "its ranks from a stage's dp, fsdp and cp ranks")
        if self.cp > 1 and t.seq_len % (2 * self.cp):
            # Load balancing cuts the sequence into 2*cp chunks (rank i holds i and 2cp-1-i).
            fail("train.seq_len", f"{t.seq_len} must be divisible by 2*cp = {2 * self.cp}")
        if self.cp > 1 and t.compile:
            fail("train.compile", "compiled attention (fullgraph) cannot hold context parallel's "
                                  "K/V all-gather; set train.compile=false or parallel.cp=1")
        if getattr(m, "num_experts", None) and self.efsdp > 1:  # FSDP2 shards experts' dim 1 evenly only
            for key in ("hidden_size", m.expert_width_field):  # w13 (E, D, 2F) and w2 (E, F, D)
                size = getattr(m, key)
                if size % self.efsdp:
                    fail("parallel", f"routed experts are FSDP-sharded on dim 1 over fsdp*cp/ep = {self.efsdp} "
                                     f"ranks, which must divide model.{key} ({size})")
        if t.reduce_dtype != "float32" and not self.fsdp_enabled:
            fail("train.reduce_dtype", f"{t.reduce_dtype}: only FSDP reduces gradients, and this layout "
                                       "has none (dp*fsdp*cp = 1); leave it float32")
        if self.world_size > 1 and getattr(m, "tie_word_embeddings", False):
            fail("model.tie_word_embeddings", "a tied LM head is supported in one process only (each "
                                              "rank's initialisation and sharding would untie it)")
        # Heads need not divide by cp: K/V are all-gathered whole (context_parallel.py).
        if self.pp == 1:
            return
        p = cfg.parallel
        if m.num_layers < self.pp:
            fail("parallel.pp", f"{self.pp} stages but model.num_layers is {m.num_layers}")
        if p.pp_schedule == "dualpipev" and t.grad_accum < 2 * self.pp:
            fail("train.grad_accum", f"dualpipev needs at least 2 * pp = {2 * self.pp} micro-batches, "
                                     f"got {t.grad_accum}")
        if self.cp > 1:
            fail("parallel.cp", "pipeline x context parallel is not wired yet")
        if p.pp_overlap and t.activation_checkpoint != "none":
            fail("parallel.pp_overlap", "activation checkpointing runs each layer whole (no phases to "
                                        "overlap); set train.activation_checkpoint=none or parallel.pp_overlap=false")
        try:  # the layer split (parallel.pp_layers) the stages will hold
            split_layers(m.num_layers, num_virtual_stages(self.pp, p.pp_schedule), p.pp_layers,
                         v_shape=p.pp_schedule == "dualpipev")
        except ValueError as e:
            raise ConfigError(f"{src}: {e}") from None

    # --- "is X enabled"

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded (FSDP2) whenever a stage has more than one rank; cp ranks and
        dp replicas are data-parallel for the parameters too. One GPU on the FSDP path too."""
        return self.dp * self.fsdp * self.cp > 1 or bool(self.one_gpu_fsdp)

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def ep_dispatch(self) -> bool:
        """Each MoE block's dispatcher is the all-to-all one (parallelize.py): ep > 1, or one GPU on
        the FSDP path (its one-rank all-to-all)."""
        return self.ep > 1 or bool(self.one_gpu_fsdp)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def efsdp(self) -> int:
        shard = self.fsdp * self.cp
        return shard // self.ep if shard % self.ep == 0 else 1

    @property
    def edp(self) -> int:
        return self.dp * self.fsdp * self.cp // (self.efsdp * self.ep)

    @property
    def experts_alone(self) -> bool:
        """Under FSDP, each rank's routed experts are its own: no FSDP shard of them (efsdp = 1)
        and no replica (edp = 1), e.g. fsdp=8 ep=8. FSDP then leaves them out (parallelize.py):
        nothing to gather or reduce, and they keep the one-GPU path's bf16 copy and in-place
        weight gradients."""
        return self.fsdp_enabled and self.efsdp == 1 and self.edp == 1 and self.one_gpu_fsdp != "experts_sharded"

    # --- coordinates (pure arithmetic; valid before the meshes exist)

    @property
    def coords(self) -> dict:
        r, out = self.rank, {}
        for name, size in (("cp", self.cp), ("fsdp", self.fsdp), ("dp", self.dp), ("pp", self.pp)):
            out[name], r = r % size, r // size
        return out

    @property
    def data_parallel_rank(self) -> int:
        """Which rows of the global batch this rank reads, of data_parallel_size (cp ranks share them)."""
        c = self.coords
        return c["dp"] * self.fsdp + c["fsdp"]

    @property
    def data_parallel_size(self) -> int:
        """How many distinct row slices one micro-batch index covers: dp replicas x fsdp shards."""
        return self.dp * self.fsdp

    @property
    def cp_rank(self) -> int:
        return self.coords["cp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def ep_rank(self) -> int:
        """Position in the expert-parallel group: the rank holds experts
        [ep_rank * E/ep, (ep_rank + 1) * E/ep)."""
        return (self.data_parallel_rank * self.cp + self.cp_rank) % self.ep

    # --- process group and meshes (collective: every rank calls this)

    def init(self, device: torch.device, timeout_s: float | None = None) -> "ParallelDims":
        """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT; NCCL on
        CUDA, gloo on CPU) unless one exists, then build the meshes. World size 1: nothing (but one
        GPU on the FSDP path: a one-rank group of its own). timeout_s (parallel.timeout_s): how long
        any collective may wait, in every group made after it too."""
        if not self.distributed and not self.one_gpu_fsdp:
            return self
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            timeout = None
            if timeout_s:
                # Process-wide on purpose: DeviceMesh's groups and the checkpointer's new_group take
                # torch's module default, and no argument of theirs reaches it. close() restores it.
                self._default_timeouts = (c10d.default_pg_timeout, c10d.default_pg_nccl_timeout)
                timeout = c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timedelta(seconds=timeout_s)
            dist.init_process_group(backend, rank=self.rank, world_size=self.world_size, timeout=timeout,
                                    device_id=(torch.device("cuda", torch.cuda.current_device() if device.index is None
                                                            else device.index) if device.type == "cuda" else None),
                                    store=dist.HashStore() if self.world_size == 1 else None)
            self.owns_group = True
        self._groups_before = set(c10d._world.pg_map)  # a caller's group and its subgroups stay
        return self.build_meshes(device.type)

    def close(self, failed: bool = False):
        """Leave the process group if `init` joined it (tests reuse one group across runs): every
        group made since goes with it. In a caller's group, a run that `failed` (no model returned
        to hold DTensors on them) destroys the groups made since `init`, which would otherwise pile
        up run after run and slow every later one (docs/perf-notes.md). torch's default timeout is
        what it was."""
        if getattr(self, "owns_group", False):
            dist.destroy_process_group()
            self.owns_group = False
        elif failed and getattr(self, "_groups_before", None) is not None and dist.is_initialized():
            for group in [g for g in list(c10d._world.pg_map) if g not in self._groups_before]:
                dist.destroy_process_group(group)
        self._groups_before = None
        if getattr(self, "_default_timeouts", None):
            c10d.default_pg_timeout, c10d.default_pg_nccl_timeout = self._default_timeouts
            self._default_timeouts = None

    def build_meshes(self, device_type: str):
        """Build the DeviceMeshes and process groups. Every rank builds the meshes of every
        pipeline stage (new_group is collective over the world) and keeps its own stage's.

            stage_mesh   (dp, fsdp, cp)        cp_group for context parallel
            dense_mesh   (dp, fsdp_cp)         FSDP of dense parameters (HSDP when dp > 1)
            expert_mesh  (edp, efsdp, ep)      experts: Shard(0) on ep, FSDP on (edp, efsdp)
        """
        self.device_type = device_type
        ranks = torch.arange(self.world_size).reshape(self.pp, self.dp, self.fsdp, self.cp)
        for s, r in enumerate(ranks):
            meshes = (
                DeviceMesh(device_type, r, mesh_dim_names=("dp", "fsdp", "cp")),
                DeviceMesh(device_type, r.reshape(self.dp, self.fsdp * self.cp),
                           mesh_dim_names=("dp", "fsdp_cp")),
                DeviceMesh(device_type, r.reshape(self.edp, self.efsdp, self.ep),
                           mesh_dim_names=("edp", "efsdp", "ep")),
            )
            group = dist.new_group(r.flatten().tolist())
            if s == self.pp_rank:
                self.stage_mesh, self.dense_mesh, self.expert_mesh = meshes
                # All ranks holding the same model piece: expert-load statistics sum over it.
                self.stage_group = group
        self.cp_group = self.stage_mesh["cp"].get_group()
        self.ep_group = self.expert_mesh["ep"].get_group()
        return self

    def describe(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ("pp", "dp", "fsdp", "cp", "ep") if getattr(self, k) > 1]
        return f"world {self.world_size}" + (f" ({' x '.join(parts)})" if parts else "")
