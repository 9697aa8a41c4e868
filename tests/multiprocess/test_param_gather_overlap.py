"""parallel.overlap_param_gather: the distributed optimizer's all-gathers left in flight after the step change no
number (losses, saved weights), a save right after a step holds the updated weights, and the next forward waits for
each bucket before the first module that uses it. Real gloo processes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mp_workers
import param_gather_workers as workers
import pytest
import torch

from megatron_hpc.checkpoint.conversion import read_whole
from megatron_hpc.config.schema import CheckpointConfig, RunConfig

pytestmark = pytest.mark.multiprocess

NUM_STEPS = 6
SAVE_INTERVAL = 4
"""Saves after step 4 (between log lines' collectives only) and after the last step."""


def _config(*, tp: int = 1, overlap: bool, compiled: bool = False, **parallel: object) -> RunConfig:
    cfg = mp_workers.distributed_optimizer(mp_workers.tiny_config(tp=tp, num_steps=NUM_STEPS))
    train = dataclasses.replace(cfg.train, compile=compiled, compile_backend="eager")  # eager: dynamo's trace only
    return dataclasses.replace(cfg, train=train,
                               parallel=dataclasses.replace(cfg.parallel, overlap_param_gather=overlap, **parallel),
                               checkpoint=CheckpointConfig(save_interval=SAVE_INTERVAL, keep_last=2))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DP 2: off, on, on with DP rank 1's gathers late, on with the NCCL path's all-gathers and a dozen buckets, on
    under train.compile with rank 1 late (no hooks: the step waits before its forward); TP 2 x DP 2: off and on."""
    root = tmp_path_factory.mktemp("param_gather")
    two = [(_config(overlap=False), "dp2_off", ""), (_config(overlap=True), "dp2_on", ""),
           (_config(overlap=True), "dp2_on_late", "late"),
           (_config(overlap=True, grad_bucket_mb=workers.SMALL_BUCKETS), "dp2_on_scatter_buckets", "scatter"),
           (_config(overlap=True, compiled=True), "dp2_on_compiled_late", "late")]
    mp_workers.spawn(workers.training_runs, world=2, out_dir=root, num_ports=len(two), args=(two, str(root)))
    four = [(_config(tp=2, overlap=False), "tp2dp2_off", ""), (_config(tp=2, overlap=True), "tp2dp2_on", "")]
    mp_workers.spawn(workers.training_runs, world=4, out_dir=root, num_ports=len(four), args=(four, str(root)))
    return root


def _series(root: Path, name: str, key: str) -> list[float]:
    rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(1, NUM_STEPS + 1))
    return [r[key] for r in rows]


def _weights(root: Path, name: str, iteration: int) -> list[dict[str, torch.Tensor]]:
    whole = read_whole(root / name / "checkpoints", iteration=iteration)
    assert whole.iteration == iteration
    return [dict(shard["model"]) for shard in whole.grid[0]]


@pytest.mark.parametrize("name,off", [("dp2_on", "dp2_off"), ("dp2_on_late", "dp2_off"),
                                      ("tp2dp2_on", "tp2dp2_off")])
def test_losses_and_saved_weights_are_bit_identical(runs: Path, name: str, off: str) -> None:
    for key in ("lm_loss", "grad_norm"):
        assert _series(runs, name, key) == _series(runs, off, key), key
    for iteration in (SAVE_INTERVAL, NUM_STEPS):
        for got, want in zip(_weights(runs, name, iteration), _weights(runs, off, iteration), strict=True):
            assert got.keys() == want.keys()
            for key in want:
                assert torch.equal(got[key], want[key]), (iteration, key)


def test_under_torch_compile_the_step_waits_before_its_forward(runs: Path) -> None:
    # dynamo's trace may reorder float sums against eager mode, so within float tolerance rather than bit for bit.
    for key in ("lm_loss", "grad_norm"):
        got = torch.tensor(_series(runs, "dp2_on_compiled_late", key), dtype=torch.float64)
        want = torch.tensor(_series(runs, "dp2_off", key), dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0.0)


def test_saved_weights_are_the_updated_ones(runs: Path) -> None:
    # DP rank 1 held its gathers back 1.5 s after step 4's update, and DP rank 0 writes the checkpoint: its step-4
    # save still holds every weight as updated by step 4, which differ from step 6's (so a stale half would show).
    late, off = _weights(runs, "dp2_on_late", SAVE_INTERVAL)[0], _weights(runs, "dp2_off", SAVE_INTERVAL)[0]
    final = _weights(runs, "dp2_off", NUM_STEPS)[0]
    assert all(not torch.equal(off[k], final[k]) for k in off)
    assert all(torch.equal(late[k], off[k]) for k in off)


def test_nccl_collectives_and_many_buckets_match_within_float_tolerance(runs: Path) -> None:
    for key in ("lm_loss", "grad_norm"):
        got = torch.tensor(_series(runs, "dp2_on_scatter_buckets", key), dtype=torch.float64)
        want = torch.tensor(_series(runs, "dp2_off", key), dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0.0)
    got, want = _weights(runs, "dp2_on_scatter_buckets", NUM_STEPS)[0], _weights(runs, "dp2_off", NUM_STEPS)[0]
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def forward(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return mp_workers.spawn(workers.forward_waits, world=2, out_dir=tmp_path_factory.mktemp("forward"))[0]


def test_every_module_of_the_next_forward_sees_the_updated_weights(forward: dict) -> None:
    run = forward["hooked"]
    assert run["seen"].keys() == run["after"].keys()
    changed = [n for n in run["after"] if not torch.equal(run["after"][n], run["before"][n])]
    assert len(changed) == len(run["after"])  # the step moved every parameter, so stale weights would show
    for name, value in run["seen"].items():
        assert torch.equal(value, run["after"][name]), name


def test_without_the_waits_the_forward_reads_stale_weights(forward: dict) -> None:
    # The control: the same step and forward without the optimizer's pre-hooks. DP rank 0 updated its own slice in
    # place, so what it read differs from the gathered weights exactly where DP rank 1's half was not there yet,
    # and there it holds the weights from before the step.
    run = forward["unhooked"]
    stale = 0
    for name, seen in run["seen"].items():
        differs = seen != run["after"][name]
        stale += int(differs.sum())
        assert torch.equal(seen[differs], run["before"][name][differs]), name
    assert stale > 0


def test_the_first_module_to_run_holds_the_last_bucket_which_is_gathered_first(forward: dict) -> None:
    run = forward["hooked"]
    assert run["first_module"] == "wte" and run["num_buckets"] > 3
    assert run["wte_bucket"] == run["num_buckets"] - 1
