"""TensorBoard event files of a short run, read back with tensorboard's EventAccumulator."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_hpc.config.schema import CompilePhaseConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
from megatron_hpc.train.entry import plan_for_torchrun, run_training


def _cfg(**train: object) -> RunConfig:
    return RunConfig(
        name="tb",
        model=ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16,
                          max_position_embeddings=16, vocab_size=300),
        train=TrainConfig(**{"num_steps": 5, "micro_batch_size": 2, "global_batch_size": 4, "log_interval": 1,
                             "eval_interval": 3, "eval_iters": 1, **train}),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=1),
        compile=CompilePhaseConfig(num_steps=1),
    )


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def _scalars(acc: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_event_files_hold_megatrons_scalars(tmp_path: Path) -> None:
    spec = plan_for_torchrun(_cfg())
    # Planned for hardware other than the runtime's (as an A100 platform file runs as p5): MFU takes the plan's peak.
    spec = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, peak_tflops_per_worker=4.0))
    assert run_training(spec, run_dir=tmp_path) == 0
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "batch-size", "loss-scale", "samples-per-second",
            "tokens-per-second", "tflops-per-worker", "mfu", "mem-max-rss-bytes", "lm loss validation",
            "lm loss validation ppl", "lm loss vs samples", "iteration-time"} <= tags
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = {r["iteration"]: r for r in rows if r["phase"] == "run"}
    valid = {r["iteration"]: r for r in rows if r["phase"] == "valid"}
    assert _scalars(acc, "lm loss") == pytest.approx({i: r["lm_loss"] for i, r in train.items()}, rel=1e-6)
    assert _scalars(acc, "learning-rate") == pytest.approx({i: r["lr"] for i, r in train.items()}, rel=1e-6)
    assert _scalars(acc, "batch-size") == {i: 4.0 for i in train}
    assert _scalars(acc, "lm loss validation") == pytest.approx({i: r["lm_loss"] for i, r in valid.items()},
                                                                rel=1e-6)
    assert sorted(valid) == [3, 5]
    assert _scalars(acc, "lm loss vs samples") == pytest.approx({4 * i: r["lm_loss"] for i, r in train.items()},
                                                                rel=1e-6)
    # Warm-up: steps 1 and 2 are kept out of every throughput scalar.
    tokens = _scalars(acc, "tokens-per-second")
    assert sorted(tokens) == [3, 4, 5]
    assert tokens == pytest.approx({i: train[i]["tokens_per_s"] for i in (3, 4, 5)}, rel=1e-6)
    samples = _scalars(acc, "samples-per-second")
    assert samples == pytest.approx({i: v / 16 for i, v in tokens.items()}, rel=1e-5)
    # The cpu platform's own nominal peak is 1 TFLOP/s; the plan's 4 is what MFU divides by.
    assert _scalars(acc, "mfu") == pytest.approx({i: v / 4.0 for i, v in _scalars(acc, "tflops-per-worker").items()},
                                                 rel=1e-6)
    assert all(v > 1e6 for v in _scalars(acc, "mem-max-rss-bytes").values())


def test_disabled_writes_nothing(tmp_path: Path) -> None:
    assert run_training(plan_for_torchrun(_cfg(tensorboard=False, num_steps=1, eval_interval=0)), run_dir=tmp_path) == 0
    assert not (tmp_path / "tensorboard").exists()
