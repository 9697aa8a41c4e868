"""Rank layout of the parallel mesh (tp, dp, pp). Pure: values in, values out.

Megatron's order (its default "tp-cp-ep-dp-pp", megatron/core/parallel_state.py): tensor parallel is the
fastest-varying dimension, so a TP group is contiguous ranks inside one node; data parallel comes next
(strided by tp); pipeline parallel is slowest (strided by tp * dp), so pipeline stages sit on different
nodes. Context and expert parallelism will slot in between tp and dp (DIMS keeps that order).
A group along some dimensions is the set of ranks that differ only in those coordinates; every group of
the mesh is derived here, by one function, and built into process groups in one place
(parallel/context.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import product

DIMS = ("tp", "dp", "pp")
"""Mesh dimensions, fastest-varying first."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Mesh:
    num_nodes: int
    workers_per_node: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    def __post_init__(self) -> None:
        # The planner refuses bad sizes with a fix first; reaching this is a bug in the caller.
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if min(self.num_nodes, self.workers_per_node, self.tensor_parallel, self.pipeline_parallel) < 1 or \
                self.world_size % model_parallel:
            raise ValueError(f"invalid mesh: {self.num_nodes} node(s) x {self.workers_per_node} worker(s), "
                             f"tp {self.tensor_parallel} x pp {self.pipeline_parallel}")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.workers_per_node

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel)

    @property
    def sizes(self) -> dict[str, int]:
        """Size of each dimension, in DIMS order."""
        return {"tp": self.tensor_parallel, "dp": self.data_parallel, "pp": self.pipeline_parallel}

    def _strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for dim, size in self.sizes.items():
            strides[dim] = stride
            stride *= size
        return strides

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate along every dimension."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        strides = self._strides()
        return {dim: rank // strides[dim] % size for dim, size in self.sizes.items()}

    def rank_at(self, **coords: int) -> int:
        """The rank at these coordinates (a dimension left out is 0)."""
        strides = self._strides()
        return sum(coords.get(dim, 0) * strides[dim] for dim in self.sizes)

    def groups(self, *dims: str) -> list[list[int]]:
        """Every group of ranks that differ only along `dims`, ordered by their first rank."""
        unknown = [d for d in dims if d not in DIMS]
        if unknown or not dims:
            raise ValueError(f"mesh dimensions are {DIMS}; got {dims}")
        sizes = self.sizes
        fixed = [d for d in DIMS if d not in dims]
        out = []
        for outer in product(*(range(sizes[d]) for d in fixed)):
            base = dict(zip(fixed, outer))
            out.append(sorted(self.rank_at(**base, **dict(zip(dims, inner)))
                              for inner in product(*(range(sizes[d]) for d in dims))))
        return sorted(out)

    def group_of(self, rank: int, *dims: str) -> list[int]:
        """The group along `dims` that holds `rank`."""
        return next(g for g in self.groups(*dims) if rank in g)

    def iter_groups(self) -> Iterator[tuple[str, list[list[int]]]]:
        """(dimension, its groups) for every dimension, in DIMS order: what a process needs to build."""
        for dim in DIMS:
            yield dim, self.groups(dim)

    def embedding_groups(self) -> list[list[int]]:
        """Megatron's embedding groups: the first and the last pipeline stage of each (tp, dp) pair, which both
        hold the tied word embeddings and all-reduce their gradients. Empty without pipelining."""
        if self.pipeline_parallel == 1:
            return []
        return [[group[0], group[-1]] for group in self.groups("pp")]

    def tp_rank(self, rank: int) -> int:
        return self.coords(rank)["tp"]

    def dp_rank(self, rank: int) -> int:
        return self.coords(rank)["dp"]

    def pp_rank(self, rank: int) -> int:
        return self.coords(rank)["pp"]

    def tp_groups(self) -> list[list[int]]:
        return self.groups("tp")

    def dp_groups(self) -> list[list[int]]:
        return self.groups("dp")

    def tp_group_of(self, rank: int) -> list[int]:
        return self.group_of(rank, "tp")

    def dp_group_of(self, rank: int) -> list[int]:
        return self.group_of(rank, "dp")
