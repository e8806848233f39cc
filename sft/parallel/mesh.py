"""How the ranks are laid out: one module builds every device mesh, from one world mesh.

    world = dp_replicate x dp_shard x cp                    (rank-major in that order)
    experts: the ranks of a replica = efsdp x ep            (ep the consecutive ranks)

* `dp_replicate` (fsdp.replicate_degree): HSDP's replicas; each holds the whole model, sharded over
  its own ranks (e.g. one replica per node, so all-gathers stay inside a node).
* `dp_shard` x `cp`: the ranks of one replica. FSDP shards the model over all of them (the
  `dp_shard_cp` axis of `fsdp_mesh`): context parallelism splits rows, not weights.
* `cp` (cp.degree): the ranks that split each row's tokens, consecutive, so a cp group sits inside
  a node (`cp_mesh`).
* `ep` (moe.ep_degree): expert parallelism. Each rank of an ep group holds 1/ep of every MoE
  block's experts and the group's tokens travel to their experts (sft/models/moe.py); consecutive
  ranks, so the all-to-alls stay inside a node. The expert weights are FSDP-sharded over the ranks
  orthogonal to ep (`efsdp`, TorchTitan's dp_shard_mod_ep; `expert_fsdp_mesh`); everything else
  stays sharded over all the ranks of a replica.
* data parallelism: the ranks that read different rows, dp_replicate x dp_shard (`dp_rank`,
  `dp_size`); the ranks of a cp group read the same rows.

Every other module asks this one for what it needs: FSDP for its mesh, context parallelism for its
group, the data sampler, evaluation and the metrics for the data-parallel rank and size, the planner
and the checkpoints for the global batch and the shard ranks. "Off" is one property each
(`cp_enabled`, `replicated`). The views are unflattened from the world mesh (TorchTitan's way), so
each axis is a group of its own and nothing is sliced out of a flattened one. The layout is the one
checkpoints have always been written in (FSDP shards over the same ranks in the same order), and
they resume under any other layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sft.config import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from sft.config import Config


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of each axis for `world_size` ranks (validated together), this rank's place in
    them, and (once `build` has run) the named mesh."""

    world_size: int
    replicate: int = 1
    """fsdp.replicate_degree"""
    cp: int = 1
    """cp.degree"""
    ep: int = 1
    """moe.ep_degree"""
    rank: int = 0
    fsdp_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    """built: (dp_shard_cp,), or (dp_replicate, dp_shard_cp) with HSDP"""
    cp_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    """built, with context parallelism: (cp,)"""
    ep_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    """built, with expert parallelism: (ep,)"""
    expert_fsdp_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    """built, with expert parallelism: (efsdp,), the ranks that shard each ep rank's experts"""

    @classmethod
    def of(cls, cfg: Config, world_size: int, rank: int = 0) -> ParallelDims:
        """The layout `cfg`'s degrees give `world_size` ranks (one clear error where they do not divide)."""
        return cls(world_size, cfg.fsdp.replicate_degree, cfg.cp.degree, cfg.moe.ep_degree, rank)

    def __post_init__(self) -> None:
        for key, degree in (("fsdp.replicate_degree", self.replicate), ("cp.degree", self.cp)):
            if degree < 1 or self.world_size % degree:
                raise ConfigError(f"{key}={degree}: must divide the {self.world_size} ranks (1 turns it off)")
        if self.world_size % (self.replicate * self.cp):
            raise ConfigError(f"fsdp.replicate_degree={self.replicate} x cp.degree={self.cp}: must divide the "
                              f"{self.world_size} ranks (each replica holds whole cp groups)")
        if self.ep < 1 or self.shard_ranks % self.ep:
            raise ConfigError(f"moe.ep_degree={self.ep}: must divide the {self.shard_ranks} ranks of a replica "
                              "(1 turns it off)")

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: those that read different rows."""
        return self.world_size // self.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def shard_ranks(self) -> int:
        """The ranks FSDP shards the model over: one replica's."""
        return self.world_size // self.replicate

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def replicated(self) -> bool:
        return self.replicate > 1

    def global_batch(self, micro_batch_size: int, grad_accum_steps: int) -> int:
        """Rows per optimizer step: micro_batch_size x grad_accum_steps x data-parallel ranks."""
        return micro_batch_size * grad_accum_steps * self.dp_size

    def build(self, device_type: str) -> ParallelDims:
        """Collective: these dims with their meshes."""
        from torch.distributed.device_mesh import init_device_mesh

        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("dp_shard_cp",))
        fsdp = world._unflatten(0, (self.replicate, self.shard_ranks), ("dp_replicate", "dp_shard_cp")) \
            if self.replicated else world
        cp = world._unflatten(0, (self.dp_size, self.cp), ("dp", "cp"))["cp"] if self.cp_enabled else None
        ep = world._unflatten(0, (self.world_size // self.ep, self.ep), ("efsdp", "ep")) if self.ep_enabled else None
        return dataclasses.replace(self, fsdp_mesh=fsdp, cp_mesh=cp, ep_mesh=ep and ep["ep"],
                                   expert_fsdp_mesh=ep and ep["efsdp"])

    @property
    def cp_group_name(self) -> str:
        return self.cp_mesh.get_group().group_name
