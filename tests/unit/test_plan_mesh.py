"""The N-dimensional mesh (tp, dp, pp): Megatron's rank order and every group derived from it."""

from __future__ import annotations

import pytest

from megatron_hpc.plan.mesh import Mesh


def test_megatron_docstring_example_16_ranks_tp2_pp4():
    # Megatron's initialize_model_parallel docstring: 16 GPUs, TP 2, PP 4 (so DP 2) gives
    # 8 tensor groups [g0, g1], [g2, g3], ...; 8 data groups [g0, g2], [g1, g3], [g4, g6], ...;
    # 4 pipeline groups [g0, g4, g8, g12], [g1, g5, g9, g13], [g2, g6, g10, g14], [g3, g7, g11, g15].
    mesh = Mesh(num_nodes=2, workers_per_node=8, tensor_parallel=2, pipeline_parallel=4)
    assert mesh.data_parallel == 2
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert mesh.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert mesh.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_coordinates_and_ranks_are_inverse():
    mesh = Mesh(num_nodes=4, workers_per_node=8, tensor_parallel=4, pipeline_parallel=2)
    seen = set()
    for rank in range(mesh.world_size):
        c = mesh.coords(rank)
        assert 0 <= c["tp"] < 4 and 0 <= c["dp"] < 4 and 0 <= c["pp"] < 2
        assert mesh.rank_at(**c) == rank
        seen.add((c["tp"], c["dp"], c["pp"]))
        assert (mesh.tp_rank(rank), mesh.dp_rank(rank), mesh.pp_rank(rank)) == (c["tp"], c["dp"], c["pp"])
    assert len(seen) == 32
    assert mesh.coords(13) == {"tp": 1, "dp": 3, "pp": 0}  # 13 = 1 + 4 * 3


def test_every_dimension_partitions_the_world_and_groups_cross_in_one_rank():
    mesh = Mesh(num_nodes=2, workers_per_node=8, tensor_parallel=2, pipeline_parallel=2)
    for dim, size in mesh.sizes.items():
        groups = mesh.groups(dim)
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(16))
    for rank in range(16):
        tp, dp, pp = (set(mesh.group_of(rank, d)) for d in ("tp", "dp", "pp"))
        assert tp & dp == tp & pp == dp & pp == {rank}
    # Two dimensions at once: the model-parallel group (tp x pp) of rank 0.
    assert mesh.group_of(0, "tp", "pp") == [0, 1, 8, 9]


def test_tp_stays_in_a_node_and_pp_crosses_nodes():
    mesh = Mesh(num_nodes=4, workers_per_node=8, tensor_parallel=8, pipeline_parallel=4)
    assert all(len({r // 8 for r in g}) == 1 for g in mesh.groups("tp"))
    assert all(len({r // 8 for r in g}) == 4 for g in mesh.groups("pp"))


def test_a_mesh_that_does_not_tile_the_world_is_a_bug():
    with pytest.raises(ValueError, match="invalid mesh"):
        Mesh(num_nodes=1, workers_per_node=6, tensor_parallel=4)
    with pytest.raises(ValueError, match="mesh dimensions"):
        Mesh(num_nodes=1, workers_per_node=2).groups("cp")
