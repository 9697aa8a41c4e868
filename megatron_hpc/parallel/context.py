"""ParallelContext: the process groups of one rank, built once from the plan's mesh and passed down.

Megatron keeps these in module globals (parallel_state.py); we keep them in one object so that a
process can hold two contexts (the tests build a TP=1 reference beside a TP=2 model).
Rank layout comes from megatron_hpc.plan.mesh (tp fastest, then dp, then pp); this is the one place
that turns its groups into process groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from megatron_hpc.parallel.device import DeviceKind, group_options
from megatron_hpc.plan.mesh import DIMS, Mesh


@dataclass(frozen=True, kw_only=True)
class ParallelContext:
    mesh: Mesh
    rank: int
    groups: dict[str, dist.ProcessGroup]
    """This rank's process group along each mesh dimension (tp, dp, pp)."""
    coords: dict[str, int]
    """This rank's coordinate along each dimension, computed once (the step reads tp_rank per parameter)."""
    embedding_group: dist.ProcessGroup | None = None
    """The first and last pipeline stage of this rank's (tp, dp) pair when this rank is one of them and the
    pipeline has two or more stages (they hold the tied embeddings); None elsewhere."""

    @classmethod
    def build(cls, mesh: Mesh, *, rank: int, kind: DeviceKind = "cpu",
              timeout: timedelta | None = None) -> ParallelContext:
        """Create every group of every mesh dimension, in the same order on all ranks.

        new_group is collective over the whole world: each rank must call it for every group,
        including the ones it is not a member of, or the ranks deadlock. `timeout` is the
        collectives' timeout: new_group does not inherit the world group's, it would be 30 minutes.
        """
        extra = {} if timeout is None else {"timeout": timeout}
        if mesh.world_size != dist.get_world_size():
            raise ValueError(f"mesh has {mesh.world_size} ranks but the process group has "
                             f"{dist.get_world_size()}")
        mine: dict[str, dist.ProcessGroup] = {}
        for dim, all_groups in mesh.iter_groups():
            for ranks in all_groups:
                group = dist.new_group(ranks, **extra, **group_options(kind, all_groups=all_groups))
                if rank in ranks:
                    mine[dim] = group
        assert set(mine) == set(DIMS), "every rank is in one group of each dimension"
        embedding = None
        all_embedding = mesh.embedding_groups()
        for ranks in all_embedding:
            group = dist.new_group(ranks, **extra, **group_options(kind, all_groups=all_embedding))
            if rank in ranks:
                embedding = group
        return cls(mesh=mesh, rank=rank, groups=mine, coords=mesh.coords(rank), embedding_group=embedding)

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.groups["tp"]

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.groups["dp"]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.groups["pp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def tp_size(self) -> int:
        return self.mesh.tensor_parallel

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def dp_size(self) -> int:
        return self.mesh.data_parallel

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def pp_size(self) -> int:
        return self.mesh.pipeline_parallel

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def is_last_rank(self) -> bool:
        # Megatron prints the iteration line from the last rank (print_rank_last), which with
        # pipeline parallelism is the one that owns the loss.
        return self.rank == self.mesh.world_size - 1
