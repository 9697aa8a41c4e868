"""ParallelContext: the TP and DP process groups of one rank, built once and passed down.

Megatron keeps these in module globals (parallel_state.py); we keep them in one object so that a
process can hold two contexts (the tests build a TP=1 reference beside a TP=2 model).
Rank layout comes from megatron_hpc.plan.mesh (TP contiguous, DP strided by TP).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from megatron_hpc.parallel.device import DeviceKind, group_options
from megatron_hpc.plan.mesh import Mesh


@dataclass(frozen=True, kw_only=True)
class ParallelContext:
    mesh: Mesh
    rank: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup

    @classmethod
    def build(cls, mesh: Mesh, *, rank: int, kind: DeviceKind = "cpu",
              timeout: timedelta | None = None) -> ParallelContext:
        """Create every TP group, then every DP group, in the same order on all ranks.

        new_group is collective over the whole world: each rank must call it for every group,
        including the ones it is not a member of, or the ranks deadlock. `timeout` is the
        collectives' timeout: new_group does not inherit the world group's, it would be 30 minutes.
        """
        extra = {} if timeout is None else {"timeout": timeout}
        if mesh.world_size != dist.get_world_size():
            raise ValueError(f"mesh has {mesh.world_size} ranks but the process group has "
                             f"{dist.get_world_size()}")
        tp_group = dp_group = None
        all_tp, all_dp = mesh.tp_groups(), mesh.dp_groups()
        for ranks in all_tp:
            group = dist.new_group(ranks, **extra, **group_options(kind, all_groups=all_tp))
            if rank in ranks:
                tp_group = group
        for ranks in all_dp:
            group = dist.new_group(ranks, **extra, **group_options(kind, all_groups=all_dp))
            if rank in ranks:
                dp_group = group
        assert tp_group is not None and dp_group is not None, "every rank is in one TP and one DP group"
        return cls(mesh=mesh, rank=rank, tp_group=tp_group, dp_group=dp_group)

    @property
    def tp_rank(self) -> int:
        return self.mesh.tp_rank(self.rank)

    @property
    def tp_size(self) -> int:
        return self.mesh.tensor_parallel

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank(self.rank)

    @property
    def dp_size(self) -> int:
        return self.mesh.data_parallel

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
