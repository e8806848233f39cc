"""How the ranks are laid out: one named device mesh for every axis, built once.

    world = dp_replicate x dp_shard x cp                    (rank-major in that order)

* `dp_replicate` (fsdp.replicate_degree): HSDP's replicas; each holds the whole model, sharded over
  its own ranks (e.g. one replica per node, so all-gathers stay inside a node).
* `dp_shard` x `cp`: the ranks of one replica. FSDP shards the model over all of them (the
  flattened axis `dp_shard_cp`): context parallelism splits rows, not weights.
* `cp` (cp.degree): the ranks that split each row's tokens, consecutive, so a cp group sits inside
  a node.
* data parallelism: the ranks that read different rows, `dp_replicate` x `dp_shard` (flattened
  `dp`); the ranks of a cp group read the same rows.

Every other module asks this one for what it needs: FSDP for its mesh, context parallelism for its
group, the data sampler, evaluation and the metrics for the data-parallel rank and size, the planner
and the checkpoints for the global batch and the shard ranks. "Off" is one property each
(`cp_enabled`, `replicated`). The layout is the one checkpoints have always been written in (FSDP
shards over the same ranks in the same order), and they resume under any other layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sft.config import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of each axis for `world_size` ranks (validated together), this rank's place in
    them, and (once `build` has run) the named mesh."""

    world_size: int
    replicate: int = 1
    """fsdp.replicate_degree"""
    cp: int = 1
    """cp.degree"""
    rank: int = 0
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for key, degree in (("fsdp.replicate_degree", self.replicate), ("cp.degree", self.cp)):
            if degree < 1 or self.world_size % degree:
                raise ConfigError(f"{key}={degree}: must divide the {self.world_size} ranks (1 turns it off)")
        if self.world_size % (self.replicate * self.cp):
            raise ConfigError(f"fsdp.replicate_degree={self.replicate} x cp.degree={self.cp}: must divide the "
                              f"{self.world_size} ranks (each replica holds whole cp groups)")

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
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def replicated(self) -> bool:
        return self.replicate > 1

    def global_batch(self, micro_batch_size: int, grad_accum_steps: int) -> int:
        """Rows per optimizer step: micro_batch_size x grad_accum_steps x data-parallel ranks."""
        return micro_batch_size * grad_accum_steps * self.dp_size

    def build(self, device_type: str) -> ParallelDims:
        """Collective: these dims with their mesh (dp_replicate, dp_shard, cp), and the flattened axes
        `dp_shard_cp` (FSDP) and `dp` (data parallelism)."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (self.replicate, self.world_size // (self.replicate * self.cp), self.cp),
                                mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return ParallelDims(self.world_size, self.replicate, self.cp, self.rank, mesh)

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP's mesh: the shard ranks, and with HSDP the replicas around them."""
        return self.mesh["dp_replicate", "dp_shard_cp"] if self.replicated else self.mesh["dp_shard_cp"]

    @property
    def cp_group_name(self) -> str:
        return self.mesh["cp"].get_group().group_name
