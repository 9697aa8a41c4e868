"""fp16: Megatron's DynamicGradScaler semantics, the autocast choice per device, and a short fp16 run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_hpc.config.schema import CompilePhaseConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
from megatron_hpc.errors import TrainingError
from megatron_hpc.train.entry import plan_for_torchrun, run_training
from megatron_hpc.train.metrics import parse_iteration_line
from megatron_hpc.train.precision import DynamicGradScaler, autocast_dtype_for, build_loss_scaler


def test_defaults_are_megatrons() -> None:
    s = DynamicGradScaler()
    assert (s.scale, s.min_scale, s.growth_factor, s.backoff_factor, s.growth_interval, s.hysteresis) == \
        (2.0**32, 1.0, 2.0, 0.5, 1000, 2)


def test_hysteresis_backoff_and_growth() -> None:
    s = DynamicGradScaler(scale=2.0**10)
    s.update(found_inf=True)
    assert s.scale == 2.0**10  # the first overflow only spends hysteresis
    s.update(found_inf=True)
    assert s.scale == 2.0**9
    s.update(found_inf=False)
    s.update(found_inf=True)
    assert s.scale == 2.0**8  # hysteresis is not refilled by good steps, only by growth
    for _ in range(999):
        s.update(found_inf=False)
    assert s.scale == 2.0**8
    s.update(found_inf=False)
    assert s.scale == 2.0**9 and s.growth_tracker == 0 and s.hysteresis_tracker == 2
    s.update(found_inf=True)
    assert s.scale == 2.0**9  # refilled hysteresis absorbs one overflow again
    for _ in range(500):
        s.update(found_inf=False)
    s.update(found_inf=True)  # an overflow resets the growth count ...
    for _ in range(999):
        s.update(found_inf=False)
    assert s.scale == 2.0**8  # ... so 999 good steps later there is no growth yet


def test_minimum_scale_and_state_dict() -> None:
    s = DynamicGradScaler(scale=2.0, hysteresis=1)
    for _ in range(3):
        s.update(found_inf=True)
    assert s.scale == 1.0
    again = DynamicGradScaler()
    again.load_state_dict(s.state_dict())
    assert (again.scale, again.growth_tracker, again.hysteresis_tracker) == (1.0, 0, s.hysteresis_tracker)


def test_autocast_dtype_per_precision_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16"):
        monkeypatch.delenv(var, raising=False)
    assert autocast_dtype_for("fp32", device_kind="cpu") is None
    assert autocast_dtype_for("bf16", device_kind="xla") is torch.bfloat16
    # the trn platforms export XLA_USE_BF16=1: the whole model is bf16 already (pure bf16, stochastic rounding)
    monkeypatch.setenv("XLA_USE_BF16", "1")
    assert autocast_dtype_for("bf16", device_kind="xla") is None
    assert autocast_dtype_for("bf16", device_kind="cpu") is torch.bfloat16
    assert autocast_dtype_for("fp16", device_kind="cpu") is torch.float16
    with pytest.raises(TrainingError, match="use bf16"):
        autocast_dtype_for("fp16", device_kind="xla")
    assert build_loss_scaler("fp16") is not None and build_loss_scaler("bf16") is None


def test_fp16_run_backs_off_from_2_pow_32_and_trains(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    cfg = RunConfig(
        name="fp16",
        model=ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16,
                          max_position_embeddings=16, vocab_size=300),
        train=TrainConfig(num_steps=16, micro_batch_size=2, global_batch_size=4, precision="fp16",
                          max_skipped_steps=3, tensorboard=False),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=1),
        compile=CompilePhaseConfig(num_steps=1),
    )
    # Many more than max_skipped_steps overflow skips in a row: routine for fp16, not an error.
    assert run_training(plan_for_torchrun(cfg), run_dir=tmp_path) == 0
    lines = [parse_iteration_line(x) for x in capsys.readouterr().out.splitlines() if "] iteration " in x]
    scales = [float(x["loss scale"]) for x in lines]
    skipped = [int(x["number of skipped iterations"]) for x in lines]
    first_good = skipped.index(0)
    assert first_good > 3
    # Overflows: the first spends hysteresis, each later one halves the scale; then it holds.
    assert scales[:first_good] == [2.0**32 / 2**max(0, i) for i in range(first_good)]
    assert all(s == scales[first_good - 1] for s in scales[first_good:])
    assert skipped == [1] * first_good + [0] * (len(lines) - first_good)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss_scale"] == scales[-1] and rows[-1]["lm_loss"] < 6.5
