"""TP, DP and micro-batching change nothing numerically: each is checked against one process."""

from __future__ import annotations

import json
from pathlib import Path

import mp_workers
import pytest
import torch

pytestmark = pytest.mark.multiprocess

RTOL = 1e-5


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Seven real training runs of 20 steps over three spawns (world 1, 2 and 4); two of them GPT-NeoX."""
    root = tmp_path_factory.mktemp("runs")
    plan = {
        1: {"dense": mp_workers.tiny_config(), "one_micro": mp_workers.tiny_config(micro_batch_size=8),
            "dense_neox": mp_workers.neox(mp_workers.tiny_config())},
        2: {"tp2": mp_workers.tiny_config(tp=2), "dp2": mp_workers.tiny_config(tp=1),
            "tp2_neox": mp_workers.neox(mp_workers.tiny_config(tp=2))},
        4: {"tp2dp2": mp_workers.tiny_config(tp=2)},
    }
    out: dict[str, list[dict]] = {}
    for world, configs in plan.items():
        run_root = root / f"world{world}"
        mp_workers.spawn(mp_workers.train_runs, world=world, out_dir=run_root, num_ports=len(configs),
                         args=(list(configs.values()), str(run_root)))
        for i, name in enumerate(configs):
            out[name] = _metrics(run_root / f"run{i}")
    return out


def _assert_same(got: list[dict], want: list[dict], key: str) -> None:
    assert [r["iteration"] for r in got] == list(range(1, 21))
    torch.testing.assert_close(torch.tensor([r[key] for r in got], dtype=torch.float64),
                               torch.tensor([r[key] for r in want], dtype=torch.float64), rtol=RTOL, atol=0.0)


def test_reference_run_learns(runs: dict[str, list[dict]]) -> None:
    losses = [r["lm_loss"] for r in runs["dense"]]
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("name", ["tp2", "dp2", "tp2dp2", "one_micro"])
def test_losses_match_single_process(runs: dict[str, list[dict]], name: str) -> None:
    _assert_same(runs[name], runs["dense"], "lm_loss")


@pytest.mark.parametrize("name", ["tp2", "dp2", "tp2dp2"])
def test_grad_norm_matches_single_process(runs: dict[str, list[dict]], name: str) -> None:
    # With TP the replicated LayerNorms, biases and positions must be counted once.
    _assert_same(runs[name], runs["dense"], "grad_norm")


@pytest.mark.parametrize("key", ["lm_loss", "grad_norm"])
def test_neox_at_tp2_matches_single_process(runs: dict[str, list[dict]], key: str) -> None:
    # Parallel residual: each branch ends in its own row-parallel all-reduce before the two are added.
    _assert_same(runs["tp2_neox"], runs["dense_neox"], key)
    assert runs["dense_neox"][-1]["lm_loss"] < 0.8 * runs["dense_neox"][0]["lm_loss"]
    assert runs["dense_neox"][-1]["lm_loss"] != runs["dense"][-1]["lm_loss"]  # another model, really


def test_samples_and_lr_identical(runs: dict[str, list[dict]]) -> None:
    for name in ("tp2", "dp2", "tp2dp2", "one_micro"):
        assert [r["consumed_samples"] for r in runs[name]] == [8 * i for i in range(1, 21)]
        assert [r["lr"] for r in runs[name]] == [r["lr"] for r in runs["dense"]]
