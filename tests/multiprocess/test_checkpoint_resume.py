"""Stopping after 10 steps and resuming in new processes gives the losses of one 20-step run.

Each resume runs in new processes (forked from the clean fork server: no state of the first run's processes, a new
process group), world 1, TP=2 and PP=2 (with dropout, so each stage's RNG must come back too), and TP=2 with
checkpoint.async_save (whose files must equal the synchronous run's); and a tiny Llama (grouped QKV shards, SwiGLU's
gate and up, RMSNorm weights with no biases, an untied output layer) at TP=2 with async saves and the distributed
optimizer (its state written in the plain layout's two groups, matrices and the 1-D norm weights).
The LR schedule spans 20 steps in both (optim.lr_decay_iters), as when train_iters is raised on
a resumed Megatron run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mp_workers
import pytest

from megatron_hpc.checkpoint.store import find_checkpoint, read_manifest
from megatron_hpc.config.schema import CheckpointConfig, RunConfig

pytestmark = pytest.mark.multiprocess


MESHES = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2_async": (2, 1), "tp2_llama_dist_opt_async": (2, 1)}
"""name -> (tensor parallel, pipeline parallel); names ending in _async save with checkpoint.async_save, names with
llama train mp_workers.llama's model with the distributed optimizer"""


def _config(mesh: str, *, num_steps: int, load: str | None = None) -> RunConfig:
    tp, pp = MESHES[mesh]
    # One micro-batch (fewer collectives); a pipeline needs at least as many micro-batches as stages.
    cfg = mp_workers.tiny_config(tp=tp, num_steps=num_steps, micro_batch_size=8 // pp)
    model, parallel = cfg.model, cfg.parallel
    if pp > 1:
        model = dataclasses.replace(model, hidden_dropout=0.1, attention_dropout=0.1)
        parallel = dataclasses.replace(parallel, pipeline=pp)
    if "llama" in mesh:
        model = mp_workers.llama(dataclasses.replace(cfg, model=model)).model
        parallel = dataclasses.replace(parallel, distributed_optimizer=True)
    return dataclasses.replace(cfg, model=model, parallel=parallel,
                               optim=dataclasses.replace(cfg.optim, lr_decay_iters=20),
                               checkpoint=CheckpointConfig(load=load, save_interval=5, keep_last=2,
                                                           async_save=mesh.endswith("_async")))


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Two spawns of two processes: first 20 steps and 10 steps, then (new processes) the resume."""
    root = tmp_path_factory.mktemp("resume")
    first, second = root / "first", root / "second"
    sizes = {name: tp * pp for name, (tp, pp) in MESHES.items()}
    plan1 = [(sizes[mesh], _config(mesh, num_steps=n), f"{part}_{mesh}") for mesh in MESHES
             for part, n in (("straight", 20), ("part1", 10))]
    mp_workers.spawn(mp_workers.sized_runs, world=2, out_dir=first, num_ports=len(plan1), args=(plan1, str(first)))
    plan2 = [(sizes[mesh], _config(mesh, num_steps=20, load=str(first / f"part1_{mesh}" / "checkpoints")),
              f"part2_{mesh}") for mesh in MESHES]
    mp_workers.spawn(mp_workers.sized_runs, world=2, out_dir=second, num_ports=len(plan2), args=(plan2, str(second)))
    return {mesh: {"straight": first / f"straight_{mesh}", "part1": first / f"part1_{mesh}",
                   "part2": second / f"part2_{mesh}"} for mesh in MESHES}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_resumed_losses_identical(runs: dict[str, dict[str, Path]], mesh: str) -> None:
    runs = runs[mesh]
    straight, part1, part2 = (_metrics(runs[k]) for k in ("straight", "part1", "part2"))
    assert [r["iteration"] for r in part1] == list(range(1, 11))
    assert [r["iteration"] for r in part2] == list(range(11, 21))
    assert [r["consumed_samples"] for r in part2] == [8 * i for i in range(11, 21)]
    for key in ("lm_loss", "grad_norm", "lr"):
        assert [r[key] for r in part1 + part2] == [r[key] for r in straight], key


@pytest.mark.parametrize("mesh", list(MESHES))
def test_saves_follow_interval_and_keep_last(runs: dict[str, dict[str, Path]], mesh: str) -> None:
    runs = runs[mesh]
    # part1 saved 5 and 10 (its end); the resumed run saved 15 and 20 into its own folder.
    part1 = runs["part1"] / "checkpoints"
    assert sorted(p.name for p in part1.iterdir()) == ["iter_0000005", "iter_0000010",
                                                      "latest_checkpointed_iteration.txt"]
    straight = runs["straight"] / "checkpoints"
    assert sorted(p.name for p in straight.iterdir() if p.is_dir()) == ["iter_0000015", "iter_0000020"]
    found = find_checkpoint(runs["part2"] / "checkpoints")
    assert found is not None and found.iteration == 20


@pytest.mark.parametrize("iteration", [5, 10])
def test_async_checkpoint_files_equal_the_sync_ones(runs: dict[str, dict[str, Path]], iteration: int) -> None:
    sync, asyn = (read_manifest(runs[mesh]["part1"] / "checkpoints" / f"iter_{iteration:07d}").files
                  for mesh in ("tp2", "tp2_async"))
    assert sync.keys() == asyn.keys()
    assert {"mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"} <= set(sync)
    # Every tensor file byte for byte (size and crc32); the main files hold the config, whose async_save differs.
    tensors = [k for k in sync if not k.endswith("model_optim_rng.pt")]
    assert len(tensors) > 20 and [sync[k] for k in tensors] == [asyn[k] for k in tensors]
