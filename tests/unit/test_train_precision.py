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
from megatron_hpc.train.precision import (
    DynamicGradScaler,
    autocast_dtype_for,
    build_loss_scaler,
    compute_label,
    set_xla_precision_env,
)


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


def test_autocast_dtype_per_precision_and_device() -> None:
    assert autocast_dtype_for("fp32", device_kind="cpu") is None
    assert autocast_dtype_for("fp32", device_kind="xla", float_dtype=torch.bfloat16) is None
    # pure bf16 on XLA (XLA_USE_BF16=1 made every float bf16, with stochastic rounding): autocast would only add casts
    assert autocast_dtype_for("bf16", device_kind="xla", float_dtype=torch.bfloat16) is None
    # a torch-xla that ignores XLA_USE_BF16 leaves float32 on the device: then autocast gives the bf16 matmuls
    assert autocast_dtype_for("bf16", device_kind="xla", float_dtype=torch.float32) is torch.bfloat16
    assert autocast_dtype_for("bf16", device_kind="cpu") is torch.bfloat16
    assert autocast_dtype_for("fp16", device_kind="cpu") is torch.float16
    with pytest.raises(TrainingError, match="use bf16"):
        autocast_dtype_for("fp16", device_kind="xla")
    assert build_loss_scaler("fp16") is not None and build_loss_scaler("bf16") is None


def test_the_configured_precision_sets_the_xla_variables() -> None:
    env = {"XLA_USE_BF16": "1", "PATH": "/bin"}
    warning = set_xla_precision_env("fp32", environ=env)
    assert env == {"PATH": "/bin"}  # cleared: it would have trained an fp32 run in bf16
    assert warning is not None and warning.startswith("XLA_USE_BF16=1 ignored: train.precision is fp32")
    env = {"XLA_USE_BF16": "1", "XLA_DOWNCAST_BF16": "1"}
    assert "XLA_USE_BF16=1 and XLA_DOWNCAST_BF16=1 ignored" in (set_xla_precision_env("fp32", environ=env) or "")
    assert env == {}
    env = {"XLA_USE_BF16": "0"}  # off already: nothing to warn about
    assert set_xla_precision_env("fp32", environ=env) is None and env == {}
    env = {}
    assert set_xla_precision_env("bf16", environ=env) is None and env == {"XLA_USE_BF16": "1"}
    env = {"XLA_DOWNCAST_BF16": "1"}  # the user's choice of bf16 flavour stays
    assert set_xla_precision_env("bf16", environ=env) is None and env == {"XLA_DOWNCAST_BF16": "1"}


def test_fp32_masters_turn_pure_bf16_off() -> None:
    """With the distributed optimizer on XLA the masters are fp32: XLA_USE_BF16 would make them bf16, so it goes,
    and the bf16 model weights need no autocast."""
    env = {"XLA_USE_BF16": "1", "PATH": "/bin"}
    warning = set_xla_precision_env("bf16", fp32_master=True, environ=env)
    assert env == {"PATH": "/bin"}
    assert warning is not None and "parallel.distributed_optimizer keeps fp32 master weights" in warning
    env = {}
    assert set_xla_precision_env("bf16", fp32_master=True, environ=env) is None and env == {}
    assert autocast_dtype_for("bf16", device_kind="xla", fp32_master=True) is None
    assert compute_label("bf16", float_dtype=torch.float32, autocast_dtype=None, fp32_master=True) == \
        "bf16 (bf16 weights, fp32 master weights and Adam state)"


def test_the_banner_says_what_the_device_computes() -> None:
    assert compute_label("fp32", float_dtype=torch.float32, autocast_dtype=None) == "fp32"
    assert compute_label("bf16", float_dtype=torch.bfloat16, autocast_dtype=None).startswith("bf16 (pure:")
    assert compute_label("bf16", float_dtype=torch.float32, autocast_dtype=torch.bfloat16) == \
        "bf16 (autocast, fp32 weights and Adam state)"
    assert compute_label("fp16", float_dtype=torch.float32, autocast_dtype=torch.float16) == \
        "fp16 (autocast, fp32 weights and Adam state, loss scaling)"


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
