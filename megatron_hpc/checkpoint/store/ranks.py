"""Who reads and writes: this rank's place in the mesh, and the two tiny collectives saves need.

Without a process group (tools, unit tests) everything runs as a world of one. The collectives
all-reduce a small float tensor on the training device, which every backend (gloo, nccl, xla)
supports; there is no object collective and no dist.barrier.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_hpc.checkpoint.store import paths
from megatron_hpc.parallel.context import ParallelContext

_CPU = torch.device("cpu")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankInfo:
    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    local_rank: int = 0
    """Index of this rank on its node."""
    ranks_per_node: int = 1
    """Ranks on each node."""
    device: torch.device = _CPU
    """Where the collectives' tensors live."""

    @classmethod
    def of(cls, ctx: ParallelContext, *, device: torch.device) -> RankInfo:
        return cls(rank=ctx.rank, world_size=ctx.world_size, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size,
                   dp_rank=ctx.dp_rank, dp_size=ctx.dp_size, pp_rank=ctx.pp_rank, pp_size=ctx.pp_size,
                   local_rank=ctx.rank % ctx.mesh.workers_per_node, ranks_per_node=ctx.mesh.workers_per_node,
                   device=device)

    @property
    def is_writer(self) -> bool:
        """DP-rank 0 of each (TP, PP) rank pair writes its mp_rank_XX[_YYY] folder (the reference's rule)."""
        return self.dp_rank == 0

    def write_phase(self, io_workers_per_node: int) -> int:
        """The save phase in which this writer writes: its index among its node's writers, io_workers_per_node
        to a phase."""
        index = paths.writer_local_index(rank=self.rank, ranks_per_node=self.ranks_per_node, tp_size=self.tp_size,
                                         dp_size=self.dp_size)
        return paths.io_phase(local_index=index, io_workers_per_node=io_workers_per_node)

    def num_write_phases(self, io_workers_per_node: int) -> int:
        """Phases of a save, the same on every rank (each ends in a barrier)."""
        return paths.num_write_phases(world_size=self.world_size, ranks_per_node=self.ranks_per_node,
                                      tp_size=self.tp_size, dp_size=self.dp_size,
                                      io_workers_per_node=io_workers_per_node)

    def _all_reduce(self, value: float, op: dist.ReduceOp) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float32, device=self.device)
        dist.all_reduce(t, op=op, group=dist.group.WORLD)
        return float(t.item())  # host sync: the answer decides what every rank does next

    def all_ok(self, ok: bool) -> bool:
        """True when `ok` on every rank; also a barrier."""
        return self._all_reduce(1.0 if ok else 0.0, dist.ReduceOp.MIN) == 1.0

    def same_everywhere(self, value: int) -> bool:
        """True when every rank passes the same small int (exact below 2**24)."""
        return self._all_reduce(float(value), dist.ReduceOp.MIN) == self._all_reduce(float(value),
                                                                                       dist.ReduceOp.MAX)

    def shared_token(self) -> str:
        """A random name chosen by rank 0 and known to all (names the temp folder of a save)."""
        mine = float(random.SystemRandom().randrange(1, 1 << 24)) if self.rank == 0 else 0.0
        return format(int(self._all_reduce(mine, dist.ReduceOp.MAX)), "x")
