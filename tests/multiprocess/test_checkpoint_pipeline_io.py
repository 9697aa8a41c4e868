"""save_checkpoint / load_checkpoint with pipeline parallelism in four real gloo processes.

Each (tp, pp) pair's DP-rank-0 rank writes mp_rank_XX_YYY in its phase (one writer per node at a time here), and
every rank reads back its own pair's file. At TP 1 x PP 2 x DP 2 the second stage's writer is local rank 2, so a
phase taken from the local rank instead of the writer's index would never come round and the save would fail.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mp_workers
import pytest
import torch
import torch.distributed as dist

from megatron_hpc.checkpoint.store import read_manifest

pytestmark = pytest.mark.multiprocess

MESHES = ((1, 2), (2, 2))
"""(tp, pp) on one node of four ranks: DP 2 and DP 1."""


def save_and_load(rank: int, world: int, ports: list[int], root: str) -> list[dict[str, Any]]:
    from megatron_hpc.checkpoint.store import RankInfo, load_checkpoint, save_checkpoint
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.plan.mesh import Mesh

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{ports[0]}")
    out = []
    for tp, pp in MESHES:
        ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=world, tensor_parallel=tp,
                                         pipeline_parallel=pp), rank=rank)
        ranks = RankInfo.of(ctx, device=torch.device("cpu"))
        where = Path(root) / f"tp{tp}pp{pp}"
        state = {"iteration": 3, "writer": [ctx.tp_rank, ctx.pp_rank, ctx.dp_rank],
                 "model": {"w": torch.full((4,), 100.0 * ctx.pp_rank + ctx.tp_rank)}}
        save_checkpoint(where, 3, state, ranks=ranks, io_workers_per_node=1)
        _, loaded = load_checkpoint(where, ranks=ranks, io_workers_per_node=1)
        out.append({"coords": [ctx.tp_rank, ctx.pp_rank, ctx.dp_rank], "writer": loaded["writer"],
                    "w": loaded["model"]["w"]})
    dist.destroy_process_group()
    return out


def test_every_stage_writes_its_folder_and_every_rank_reads_its_own(tmp_path: Path) -> None:
    results = mp_workers.spawn(save_and_load, world=4, out_dir=tmp_path / "out", args=(str(tmp_path),))
    for i, (tp, pp) in enumerate(MESHES):
        folder = tmp_path / f"tp{tp}pp{pp}" / "iter_0000003"
        assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == sorted(
            f"mp_rank_{t:02d}_{p:03d}" for t in range(tp) for p in range(pp))
        m = read_manifest(folder)
        assert (m.tensor_parallel, m.pipeline_parallel, m.data_parallel, m.world_size) == (tp, pp, 4 // (tp * pp), 4)
        for rank in range(4):
            got = results[rank][i]
            t, p, _ = got["coords"]
            assert got["writer"] == [t, p, 0]  # the pair's DP-rank-0 rank wrote what this rank read
            assert torch.equal(got["w"], torch.full((4,), 100.0 * p + t))
