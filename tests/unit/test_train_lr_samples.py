"""The LR schedule in samples, and held on skipped steps, against Megatron's formulas.

Megatron's OptimizerParamScheduler counts samples: each successful step adds the global batch size,
a skipped step adds nothing (megatron-and-launchers.md 4.2). Expected values are worked out by hand
from get_lr: warmup lr * n / warmup; cosine min + (lr - min) * (cos(pi * r) + 1) / 2 with
r = (n - warmup) / (decay - warmup); linear min + (lr - min) * (1 - r); inverse-square-root
lr * sqrt(max(warmup, 1)) / sqrt(max(n, 1)); WSD holds lr until decay - wsd_decay.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_hpc.config.schema import (
    CheckpointConfig,
    CompilePhaseConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)
from megatron_hpc.errors import ConfigError
from megatron_hpc.train.entry import plan_for_torchrun, run_training
from megatron_hpc.train.lr import decay_and_warmup_steps, lr_at

LR, MIN_LR = 6e-4, 6e-5


def _optim(**kw: object) -> OptimConfig:
    return OptimConfig(lr=LR, min_lr=MIN_LR, **kw)  # type: ignore[arg-type]


def test_warmup_in_samples_ends_inside_a_step() -> None:
    # 1000 warmup samples at 64 per step: step 15 has seen 960 samples (still warming), step 16 1024.
    optim = _optim(lr_warmup_samples=1000, lr_decay_samples=10000, lr_decay_style="cosine")
    at = lambda step: lr_at(step, optim=optim, num_steps=500, global_batch_size=64)  # noqa: E731
    assert at(0) == 0.0
    assert at(10) == pytest.approx(3.84e-4)  # 6e-4 * 640 / 1000
    assert at(15) == pytest.approx(5.76e-4)  # 6e-4 * 960 / 1000, where 15 warmup iterations would give 6e-4
    # 1024 samples: r = 24 / 9000, cos(pi r) = 0.99996491
    assert at(16) == pytest.approx(6e-5 + 0.5 * (0.99996491 + 1) * 5.4e-4, rel=1e-7)


def test_cosine_in_samples_midpoint_and_end() -> None:
    optim = _optim(lr_warmup_samples=1000, lr_decay_samples=10000, lr_decay_style="cosine")
    at = lambda step: lr_at(step, optim=optim, num_steps=500, global_batch_size=50)  # noqa: E731
    assert at(20) == pytest.approx(LR)  # 1000 samples: the last warmup value
    assert at(110) == pytest.approx(3.3e-4)  # 5500 samples: r = 1/2, (lr + min) / 2
    assert at(200) == pytest.approx(MIN_LR)  # 10000 samples: r = 1
    assert at(201) == MIN_LR  # past the decay samples


def test_decay_samples_default_to_the_whole_run() -> None:
    # lr_decay_samples unset: the run's 10 steps * 20 samples = 200; linear over (100, 200].
    optim = _optim(lr_warmup_samples=100, lr_decay_style="linear")
    at = lambda step: lr_at(step, optim=optim, num_steps=10, global_batch_size=20)  # noqa: E731
    assert at(5) == pytest.approx(LR)
    assert at(6) == pytest.approx(4.92e-4)  # r = 0.2: 6e-5 + 0.8 * 5.4e-4
    assert at(10) == pytest.approx(MIN_LR)


def test_warmup_fraction_of_decay_samples() -> None:
    # 0.01 of 100000 samples = 1000; at 256 per step, step 3 (768 samples) is still warming up.
    optim = _optim(lr_warmup_fraction=0.01, lr_decay_samples=100000)
    assert lr_at(3, optim=optim, num_steps=10, global_batch_size=256) == pytest.approx(4.608e-4)
    assert lr_at(4, optim=optim, num_steps=10, global_batch_size=256) < LR  # 1024 samples: decaying


def test_inverse_square_root_counts_samples() -> None:
    warm = _optim(lr_decay_style="inverse-square-root", lr_warmup_samples=1600, lr_decay_samples=10**6)
    assert lr_at(400, optim=warm, num_steps=10**5, global_batch_size=16) == pytest.approx(3e-4)  # sqrt(1600/6400)
    # Without warmup Megatron divides by sqrt(samples): 25 steps of 4 = 100 samples -> lr / 10.
    cold = OptimConfig(lr=LR, min_lr=0.0, lr_decay_style="inverse-square-root", lr_decay_samples=10**6)
    assert lr_at(25, optim=cold, num_steps=10**5, global_batch_size=4) == pytest.approx(6e-5)


def test_wsd_in_samples() -> None:
    # Decay 10000 samples, the last 20% (2000) anneal: hold until 8000, linear to min at 10000.
    optim = _optim(lr_decay_style="WSD", lr_wsd_decay_style="linear", lr_wsd_decay_fraction=0.2,
                   lr_decay_samples=10000)
    at = lambda step: lr_at(step, optim=optim, num_steps=1000, global_batch_size=100)  # noqa: E731
    assert [at(10), at(80)] == [LR, LR]
    assert at(90) == pytest.approx(3.3e-4)  # halfway through the anneal
    assert at(100) == pytest.approx(MIN_LR)


def test_warmup_fraction_is_not_rounded() -> None:
    # The GPT-3 recipes' 0.00125 of 123977 iterations is 154.97125 warmup iterations, as in Megatron.
    optim = _optim(lr_warmup_fraction=0.00125, lr_decay_iters=123977)
    assert decay_and_warmup_steps(optim, num_steps=10) == (123977, pytest.approx(154.97125))
    assert lr_at(154, optim=optim, num_steps=10) == pytest.approx(6e-4 * 154 / 154.97125)


def test_iterations_and_samples_do_not_mix() -> None:
    with pytest.raises(ConfigError, match="lr_warmup_iters=5"):
        lr_at(1, optim=_optim(lr_warmup_iters=5, lr_decay_samples=1000), num_steps=10, global_batch_size=8)
    with pytest.raises(ConfigError, match="lr_decay_iters=50"):
        lr_at(1, optim=_optim(lr_warmup_samples=5, lr_decay_iters=50), num_steps=10, global_batch_size=8)
    with pytest.raises(ConfigError, match="not both"):
        lr_at(1, optim=_optim(lr_warmup_samples=5, lr_warmup_fraction=0.1), num_steps=10, global_batch_size=8)
    with pytest.raises(ConfigError, match="global batch size"):
        lr_at(1, optim=_optim(lr_warmup_samples=5), num_steps=10)


def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def _fp16_config(**checkpoint: object) -> RunConfig:
    return RunConfig(
        name="fp16-lr",
        model=ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16,
                          max_position_embeddings=16, vocab_size=300),
        train=TrainConfig(num_steps=20, micro_batch_size=2, global_batch_size=4, precision="fp16",
                          max_skipped_steps=3, tensorboard=False),
        # 4 samples per step: warmup over 10 samples, linear decay to min over 40.
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, lr_warmup_samples=10, lr_decay_samples=40,
                          lr_decay_style="linear"),
        compile=CompilePhaseConfig(num_steps=1),
        checkpoint=CheckpointConfig(**checkpoint),  # type: ignore[arg-type]
    )


def test_skipped_steps_hold_the_lr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 from a loss scale of 2**32 skips its first steps; the schedule waits for the first update."""
    _single_process(monkeypatch)
    cfg = _fp16_config()
    assert run_training(plan_for_torchrun(cfg), run_dir=tmp_path) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["num_skipped_iterations"] for r in rows]
    assert len(rows) == 20 and skipped.index(0) > 3 and sum(skipped) < 20
    # LR by the number of updates before the step (the schedule has then seen 4 samples per update):
    # warmup 0, 4/10, 8/10 of 3e-3, then linear from 12 samples, r = (n - 10) / 30, to min at 40.
    by_updates = [0.0, 1.2e-3, 2.4e-3, 2.82e-3, 2.46e-3, 2.1e-3, 1.74e-3, 1.38e-3, 1.02e-3, 6.6e-4, 3e-4]
    want = [by_updates[min(i - sum(skipped[:i]), 10)] for i in range(20)]
    assert [r["applied_lr"] for r in rows] == pytest.approx(want, abs=1e-12)
    # the iteration line (and the row's lr) says what Megatron prints: the LR after the step, the next step's
    after = [by_updates[min(i + 1 - sum(skipped[:i + 1]), 10)] for i in range(20)]
    assert [r["lr"] for r in rows] == pytest.approx(after, abs=1e-12)


def test_resume_keeps_the_count_of_applied_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped after 17 steps (most skipped: the scale falls from 2**32), resumed: the LRs of the straight run."""
    import dataclasses

    from megatron_hpc.checkpoint.store import RankInfo, load_checkpoint

    _single_process(monkeypatch)
    straight = _fp16_config()
    assert run_training(plan_for_torchrun(straight), run_dir=tmp_path / "straight") == 0
    want = [r[key] for r in _rows(tmp_path / "straight") for key in ("lr", "applied_lr")]

    first = _fp16_config(save_interval=0)
    first = dataclasses.replace(first, train=dataclasses.replace(first.train, num_steps=17))
    assert run_training(plan_for_torchrun(first), run_dir=tmp_path / "split") == 0
    rows = _rows(tmp_path / "split")
    skipped = sum(r["num_skipped_iterations"] for r in rows)
    assert 0 < skipped < 17
    _found, state = load_checkpoint(tmp_path / "split" / "checkpoints", ranks=RankInfo(), io_workers_per_node=1)
    assert state["lr_scheduler"]["successful_steps"] == 17 - skipped
    assert state["lr_scheduler"]["num_steps"] == (17 - skipped) * 4  # Megatron counts samples
    # The second part keeps num_steps=20 as the schedule's span, as `submit --resume` would.
    assert run_training(plan_for_torchrun(_fp16_config(save_interval=0)), run_dir=tmp_path / "split") == 0
    assert [r[key] for r in _rows(tmp_path / "split") for key in ("lr", "applied_lr")] == pytest.approx(want, abs=1e-12)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
