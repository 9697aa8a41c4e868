"""Every recompute setting trains exactly like the plain run: real trainer processes, 20 steps, TP 1 and TP 2; and a
tiny Llama, selective at TP 2 and full at PP 2, like its plain one-process run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mp_workers
import pytest
import torch

from megatron_hpc.config.schema import RunConfig

pytestmark = pytest.mark.multiprocess

RTOL = 1e-5

SETTINGS = {
    "plain": {},
    "selective": {"recompute_granularity": "selective"},
    "uniform1": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "uniform2": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
    "block1": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
}
DROPOUT = {"attention_dropout": 0.1, "hidden_dropout": 0.1}


def _config(setting: str, *, tp: int = 1, pp: int = 1, dropout: bool = False) -> RunConfig:
    cfg = mp_workers.pipeline_config(tp=tp, pp=pp)  # four layers: uniform 2 makes two groups, block 1 leaves 3 plain
    model = dataclasses.replace(cfg.model, **SETTINGS[setting], **(DROPOUT if dropout else {}))
    return dataclasses.replace(cfg, model=model)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Sixteen training runs over two spawns (world 1, then world 2 at TP 2 or PP 2; two of them Llama)."""
    root = tmp_path_factory.mktemp("recompute")
    plan = {
        1: {**{name: _config(name) for name in SETTINGS},
            **{f"{name}_dropout": _config(name, dropout=True) for name in ("plain", "selective", "uniform2")}},
        2: {**{f"{name}_tp2": _config(name, tp=2) for name in ("plain", "selective", "uniform1")},
            # Two stages of two layers: groups and blocks are cut within each stage's own layers.
            **{f"{name}_pp2": _config(name, pp=2) for name in ("plain", "uniform2", "block1")},
            # conftest's llama_reference recomputed: the grouped attention core alone, and whole layers.
            "selective_tp2_llama": mp_workers.llama(_config("selective", tp=2)),
            "uniform1_pp2_llama": mp_workers.llama(_config("uniform1", pp=2))},
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


def test_plain_run_learns(runs: dict[str, list[dict]]) -> None:
    losses = [r["lm_loss"] for r in runs["plain"]]
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("name, reference", [
    ("selective", "plain"), ("uniform1", "plain"), ("uniform2", "plain"), ("block1", "plain"),
    ("selective_tp2", "plain_tp2"), ("uniform1_tp2", "plain_tp2"), ("plain_tp2", "plain"),
    ("uniform2_pp2", "plain_pp2"), ("block1_pp2", "plain_pp2"), ("plain_pp2", "plain"),
])
@pytest.mark.parametrize("key", ["lm_loss", "grad_norm"])
def test_recompute_matches_plain(runs: dict[str, list[dict]], name: str, reference: str, key: str) -> None:
    _assert_same(runs[name], runs[reference], key)


@pytest.mark.parametrize("name", ["selective_tp2_llama", "uniform1_pp2_llama"])
@pytest.mark.parametrize("key", ["lm_loss", "grad_norm"])
def test_recomputed_llama_matches_plain(runs: dict[str, list[dict]], llama_reference: dict[str, list[dict]],
                                        name: str, key: str) -> None:
    _assert_same(runs[name], llama_reference["llama"], key)


@pytest.mark.parametrize("name", ["selective_dropout", "uniform2_dropout"])
def test_dropout_masks_are_replayed(runs: dict[str, list[dict]], name: str) -> None:
    # Recomputation reruns dropout in backward; with the masks of the forward the runs are bit-identical.
    for key in ("lm_loss", "grad_norm"):
        assert [r[key] for r in runs[name]] == [r[key] for r in runs["plain_dropout"]]
    # ...and dropout was really on: the same seed without it trains differently.
    assert [r["lm_loss"] for r in runs["plain_dropout"]] != [r["lm_loss"] for r in runs["plain"]]
