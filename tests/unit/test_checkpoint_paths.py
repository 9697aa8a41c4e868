"""Folder-layout functions against the Megatron layout (megatron-and-launchers.md 3.1)."""

from __future__ import annotations

from pathlib import Path

from megatron_hpc.checkpoint.store import paths


def test_megatron_names() -> None:
    root = Path("/ckpt")
    assert paths.iteration_dir(root, 2000) == Path("/ckpt/iter_0002000")
    assert paths.iteration_dir(root, "release") == Path("/ckpt/release")
    main = paths.main_file(paths.iteration_dir(root, 7), 3)
    assert main == Path("/ckpt/iter_0000007/mp_rank_03/model_optim_rng.pt")
    assert paths.tensor_file(main, 12) == Path("/ckpt/iter_0000007/mp_rank_03/model_optim_rng.pt.tensors/tensor_12.pt")
    assert paths.tracker_file(root) == Path("/ckpt/latest_checkpointed_iteration.txt")


def test_temp_folders_are_not_iterations() -> None:
    tmp = paths.temp_dir(Path("/c"), 5, "ab12").name
    assert tmp == "iter_0000005.tmp-ab12"
    assert paths.parse_iteration_dirname(tmp) is None and paths.is_temp_dirname(tmp)
    assert paths.parse_iteration_dirname("iter_0000005") == 5
    assert paths.parse_iteration_dirname("iter_12345678") == 12345678
    assert paths.parse_iteration_dirname("iter_5") is None


def test_tracker_text() -> None:
    assert paths.parse_tracker("100") == 100
    assert paths.parse_tracker("100\n") == 100
    assert paths.parse_tracker("release") == "release"
    assert paths.parse_tracker("-3") is None and paths.parse_tracker("") is None


def test_io_phases_bound_concurrent_ranks() -> None:
    assert paths.num_io_phases(ranks_per_node=32, io_workers_per_node=4) == 8
    assert paths.num_io_phases(ranks_per_node=3, io_workers_per_node=4) == 1
    phases = [paths.io_phase(local_index=i, io_workers_per_node=4) for i in range(32)]
    assert max(phases.count(p) for p in set(phases)) == 4 and max(phases) == 7
