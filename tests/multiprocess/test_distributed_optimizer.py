"""The distributed optimizer (parallel.distributed_optimizer, ZeRO-1) changes nothing numerically, resumes exactly, and
its checkpoints load at another DP size: real gloo processes against one process; a tiny Llama too."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mp_workers
import pytest
import torch

from megatron_hpc.config.schema import CheckpointConfig, RunConfig

pytestmark = pytest.mark.multiprocess

RTOL = 1e-5


def _config(*, tp: int = 1, dist_opt: bool = True, num_steps: int = 20, load: Path | None = None,
            **parallel: object) -> RunConfig:
    """tiny_config with the LR schedule spanning 20 steps (so 10-step halves match) and a save at the end."""
    cfg = mp_workers.tiny_config(tp=tp, num_steps=num_steps)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr_decay_iters=20),
                              parallel=dataclasses.replace(cfg.parallel, **parallel),
                              checkpoint=CheckpointConfig(load=str(load) if load else None, save_interval=0))
    return mp_workers.distributed_optimizer(cfg) if dist_opt else cfg


SMALL_BUCKETS = 0.02
"""MiB: 5,242 fp32 elements, so the tiny model's parameters fall into a dozen buckets."""


def _llama_config() -> RunConfig:
    """conftest's llama_reference at TP 2 (DP 2 in a world of 4) with sequence parallelism and small buckets."""
    cfg = mp_workers.llama(mp_workers.pipeline_config(tp=2))
    parallel = dataclasses.replace(cfg.parallel, sequence_parallel=True, grad_bucket_mb=SMALL_BUCKETS)
    return mp_workers.distributed_optimizer(dataclasses.replace(cfg, parallel=parallel))


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """A spawn of 4 (DP 4 for 10 steps, saved; TP 2 x DP 2; with sequence parallelism and a dozen buckets, GPT and
    conftest's Llama; DP 4 with the NCCL path's reduce-scatter and all-gather), then a spawn of 2: the one-process
    references, DP 2 straight (the reduce overlapped with backward, the default; not overlapped; a dozen buckets;
    the NCCL path's collectives), DP 2 in two halves, DP 2 continuing the DP 4 checkpoint, and DP 2 without the
    all-gather."""
    root = tmp_path_factory.mktemp("distopt")
    four, two = root / "four", root / "two"
    plan4 = [(4, _config(num_steps=10), "dp4_part1"), (4, _config(tp=2), "tp2dp2"),
             (4, _config(tp=2, sequence_parallel=True, grad_bucket_mb=SMALL_BUCKETS), "tp2dp2_sp_buckets"),
             (4, _llama_config(), "tp2dp2_sp_buckets_llama"),
             (4, _config(grad_bucket_mb=SMALL_BUCKETS), "dp4_scatter_buckets", "scatter_collectives")]
    mp_workers.spawn(mp_workers.sized_runs, world=4, out_dir=four, num_ports=len(plan4), args=(plan4, str(four)))
    plan2 = [
        (1, _config(dist_opt=False), "dense"),
        (1, _config(), "dense_dist_opt"),
        (2, _config(), "dp2"),
        (2, _config(overlap_grad_reduce=False), "dp2_no_overlap"),
        (2, _config(grad_bucket_mb=SMALL_BUCKETS), "dp2_buckets"),
        (2, _config(), "dp2_scatter", "scatter_collectives"),
        (2, _config(num_steps=10), "dp2_part1"),
        (2, _config(load=two / "dp2_part1" / "checkpoints"), "dp2_part2"),
        (2, _config(load=four / "dp4_part1" / "checkpoints"), "dp2_from_dp4"),
        (2, _config(), "dp2_no_allgather", "no_param_allgather"),
    ]
    mp_workers.spawn(mp_workers.sized_runs, world=2, out_dir=two, num_ports=len(plan2), args=(plan2, str(two)))
    out = {entry[2]: _metrics(four / entry[2]) for entry in plan4}
    out.update({entry[2]: _metrics(two / entry[2]) for entry in plan2})
    return out


def _series(rows: list[dict], key: str, steps: range = range(1, 21)) -> torch.Tensor:
    assert [r["iteration"] for r in rows] == list(steps)
    return torch.tensor([r[key] for r in rows], dtype=torch.float64)


@pytest.mark.parametrize("name", ["dp2", "dp2_no_overlap", "dp2_buckets", "dp2_scatter", "dp4_scatter_buckets",
                                  "tp2dp2", "tp2dp2_sp_buckets", "dense_dist_opt"])
@pytest.mark.parametrize("key", ["lm_loss", "grad_norm"])
def test_distributed_optimizer_matches_single_process(runs: dict[str, list[dict]], name: str, key: str) -> None:
    torch.testing.assert_close(_series(runs[name], key), _series(runs["dense"], key), rtol=RTOL, atol=0.0)


@pytest.mark.parametrize("key", ["lm_loss", "grad_norm"])
def test_distributed_optimizer_llama_matches_single_process(runs: dict[str, list[dict]],
                                                            llama_reference: dict[str, list[dict]], key: str) -> None:
    # No biases: the flat buffers hold matrices and the RMSNorm weights (the no-decay group) only.
    torch.testing.assert_close(_series(runs["tp2dp2_sp_buckets_llama"], key), _series(llama_reference["llama"], key),
                               rtol=RTOL, atol=0.0)


def test_resume_from_distributed_optimizer_checkpoint_is_exact(runs: dict[str, list[dict]]) -> None:
    part1, part2 = runs["dp2_part1"], runs["dp2_part2"]
    assert [r["iteration"] for r in part2] == list(range(11, 21))
    for key in ("lm_loss", "grad_norm", "lr"):
        assert [r[key] for r in part1 + part2] == [r[key] for r in runs["dp2"]], key


@pytest.mark.parametrize("key", ["lm_loss", "grad_norm"])
def test_checkpoint_saved_at_dp4_continues_at_dp2(runs: dict[str, list[dict]], key: str) -> None:
    dense = _series(runs["dense"], key)
    torch.testing.assert_close(_series(runs["dp4_part1"], key, range(1, 11)), dense[:10], rtol=RTOL, atol=0.0)
    # Adam's moments came back whole from four slices and were cut into two: steps 11-20 go on as one process does.
    torch.testing.assert_close(_series(runs["dp2_from_dp4"], key, range(11, 21)), dense[10:], rtol=RTOL, atol=0.0)


def test_missing_parameter_allgather_is_caught(runs: dict[str, list[dict]]) -> None:
    # Each rank keeps stale weights outside its slice: the losses leave the reference's.
    broken, dense = _series(runs["dp2_no_allgather"], "lm_loss"), _series(runs["dense"], "lm_loss")
    torch.testing.assert_close(broken[:1], dense[:1], rtol=RTOL, atol=0.0)  # the first step's forward is before it
    assert not torch.allclose(broken, dense, rtol=RTOL, atol=0.0)
