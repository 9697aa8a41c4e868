"""Rank layout of the TP x DP mesh. Pure: values in, values out.

Megatron's layout (shared/reference/neuron-xla.md 3.3): tensor-parallel groups are contiguous
ranks [k*tp, (k+1)*tp), so they stay inside a node; data-parallel groups are strided by tp.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Mesh:
    num_nodes: int
    workers_per_node: int
    tensor_parallel: int

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.workers_per_node

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.tensor_parallel

    def tp_rank(self, rank: int) -> int:
        return rank % self.tensor_parallel

    def dp_rank(self, rank: int) -> int:
        return rank // self.tensor_parallel

    def tp_groups(self) -> list[list[int]]:
        """Every tensor-parallel group, contiguous ranks."""
        tp = self.tensor_parallel
        return [list(range(k * tp, (k + 1) * tp)) for k in range(self.data_parallel)]

    def dp_groups(self) -> list[list[int]]:
        """Every data-parallel group, ranks strided by the TP size."""
        return [list(range(j, self.world_size, self.tensor_parallel))
                for j in range(self.tensor_parallel)]

    def tp_group_of(self, rank: int) -> list[int]:
        return self.tp_groups()[self.dp_rank(rank)]

    def dp_group_of(self, rank: int) -> list[int]:
        return self.dp_groups()[self.tp_rank(rank)]
