"""Validation: Megatron's block, the JSONL rows, which samples are read, and the valid split's size."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from megatron_hpc.config.schema import (
    CompilePhaseConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)
from megatron_hpc.data.indexed import IndexedDatasetWriter
from megatron_hpc.data.synthetic import SyntheticTokens
from megatron_hpc.evaluate.perplexity import capped_ppl
from megatron_hpc.plan.batch import num_valid_samples
from megatron_hpc.train.entry import plan_for_torchrun, run_training
from megatron_hpc.train.evaluate import VALID_SAMPLE_OFFSET, OffsetSynthetic
from megatron_hpc.train.metrics import format_validation_block

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)


def _cfg(data: DataConfig | None = None, **train: object) -> RunConfig:
    return RunConfig(
        name="tiny",
        model=ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16,
                          max_position_embeddings=16, vocab_size=300),
        train=TrainConfig(**{"num_steps": 10, "micro_batch_size": 2, "global_batch_size": 4, "log_interval": 5,
                             "eval_interval": 4, "eval_iters": 2, "tensorboard": False, **train}),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=1),
        compile=CompilePhaseConfig(num_steps=3),
        data=data or DataConfig(),
    )


def test_block_is_megatrons() -> None:
    # Written by hand from the reference (4.1): exp(2.5) = 12.182494, the dash line one longer.
    line = " validation loss at iteration 10 | lm loss value: 2.500000E+00 | lm loss PPL: 1.218249E+01 | "
    dashes = "-" * (len(line) + 1)  # Megatron: length = len(string) + 1
    assert format_validation_block(10, lm_loss=2.5) == f"{dashes}\n{line}\n{dashes}"
    assert capped_ppl(25.0) == pytest.approx(math.exp(20))  # capped
    assert "lm loss PPL: 4.851652E+08 |" in format_validation_block(3, lm_loss=25.0)


def test_synthetic_valid_ids_are_disjoint_from_training() -> None:
    tokens = SyntheticTokens(vocab_size=300, seq_length=16, seed=7)
    valid = OffsetSynthetic(tokens).batch([0, 5])
    np.testing.assert_array_equal(valid[1].numpy(), tokens.sample(VALID_SAMPLE_OFFSET + 5))
    assert not np.array_equal(valid[0].numpy(), tokens.sample(0))


def test_valid_sample_count_is_megatrons() -> None:
    # GPT-3 175B HEAD script: train 500000, eval every 1000 for 10 iterations, GBS 1536.
    assert num_valid_samples(train_iters=500000, eval_interval=1000, eval_iters=10,
                             global_batch_size=1536) == 501 * 10 * 1536
    assert num_valid_samples(train_iters=10, eval_interval=4, eval_iters=2, global_batch_size=4) == 24


def test_evaluates_every_interval_and_at_the_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_training(plan_for_torchrun(_cfg(num_steps=8, eval_interval=3, log_interval=4)), run_dir=tmp_path) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in rows if r["phase"] == "valid"]
    assert [r["iteration"] for r in valid] == [3, 6, 8]
    assert [r["iteration"] for r in rows if r["phase"] == "run"] == [4, 8]
    assert all(r["lm_loss_ppl"] == pytest.approx(math.exp(r["lm_loss"])) for r in valid)
    assert valid[-1]["lm_loss"] < valid[0]["lm_loss"] < math.log(384) + 0.5  # it learns, from about ln(V)
    out = capsys.readouterr().out.splitlines()
    at = [i for i, line in enumerate(out) if line.startswith(" validation loss at iteration ")]
    assert len(at) == 3
    for i, row in zip(at, valid):
        assert out[i] == format_validation_block(row["iteration"], lm_loss=row["lm_loss"]).splitlines()[1]
        assert set(out[i - 1]) == {"-"} and out[i - 1] == out[i + 1]


def test_no_validation_when_interval_is_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_training(plan_for_torchrun(_cfg(eval_interval=0, num_steps=2)), run_dir=tmp_path) == 0
    assert "validation loss at" not in capsys.readouterr().out
    assert all(json.loads(x)["phase"] == "run" for x in (tmp_path / "metrics.jsonl").read_text().splitlines())


def _corpus(path: Path) -> str:
    prefix = str(path / "corpus")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        for _ in range(200):
            writer.add_document(rng.integers(0, 300, size=int(rng.integers(5, 60))))
    return prefix


def test_indexed_reads_the_valid_split_with_megatrons_count(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    data = DataConfig(source="indexed", path=_corpus(tmp_path), split="80,15,5", cache_path=str(cache))
    assert run_training(plan_for_torchrun(_cfg(data, num_steps=6, eval_interval=3)), run_dir=tmp_path / "run") == 0
    descriptions = [json.loads(p.read_text()) for p in cache.glob("*-GPTDataset-valid-description.txt")]
    assert [d["num_samples"] for d in descriptions] == [(6 // 3 + 1) * 2 * 4]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if r["phase"] == "valid"] == [3, 6]


def test_zero_valid_weight_warns_and_skips(tmp_path: Path) -> None:
    data = DataConfig(source="indexed", path=_corpus(tmp_path), split="100,0,0", cache_path=str(tmp_path / "c"))
    with pytest.warns(UserWarning, match="valid split no weight"):
        assert run_training(plan_for_torchrun(_cfg(data, num_steps=2)), run_dir=tmp_path / "run") == 0
    assert all(json.loads(x)["phase"] == "run" for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
