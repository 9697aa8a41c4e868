"""The LR schedule against Megatron's formulas (megatron-and-launchers.md 4.2)."""

from __future__ import annotations

import math

import pytest

from megatron_hpc.config.schema import OptimConfig
from megatron_hpc.errors import ConfigError
from megatron_hpc.train.lr import decay_and_warmup_steps, lr_at

LR, MIN_LR = 6e-4, 6e-5


def _optim(**kw: object) -> OptimConfig:
    return OptimConfig(lr=LR, min_lr=MIN_LR, **kw)  # type: ignore[arg-type]


def test_warmup_is_linear_from_zero() -> None:
    optim = _optim(lr_warmup_iters=10, lr_decay_iters=100)
    for step in range(11):
        assert lr_at(step, optim=optim, num_steps=100) == pytest.approx(LR * step / 10)


def test_cosine_decay_formula() -> None:
    optim = _optim(lr_warmup_iters=10, lr_decay_iters=100, lr_decay_style="cosine")
    for step in (11, 25, 55, 80, 99, 100):
        r = (step - 10) / 90
        want = MIN_LR + 0.5 * (math.cos(math.pi * r) + 1) * (LR - MIN_LR)
        assert lr_at(step, optim=optim, num_steps=100) == pytest.approx(want)
    assert lr_at(55, optim=optim, num_steps=100) == pytest.approx((LR + MIN_LR) / 2)


def test_after_decay_is_min_lr() -> None:
    optim = _optim(lr_warmup_iters=10, lr_decay_iters=50)
    assert [lr_at(s, optim=optim, num_steps=200) for s in (51, 120, 199)] == [MIN_LR] * 3


def test_linear_and_constant() -> None:
    linear = _optim(lr_decay_style="linear", lr_decay_iters=100)
    assert lr_at(25, optim=linear, num_steps=100) == pytest.approx(MIN_LR + 0.75 * (LR - MIN_LR))
    constant = _optim(lr_decay_style="constant", lr_warmup_iters=4)
    assert lr_at(2, optim=constant, num_steps=100) == pytest.approx(LR / 2)
    assert lr_at(90, optim=constant, num_steps=100) == LR


def test_decay_defaults_to_num_steps_and_fraction_uses_decay_steps() -> None:
    assert decay_and_warmup_steps(_optim(), num_steps=300) == (300, 0)
    assert decay_and_warmup_steps(_optim(lr_warmup_fraction=0.01, lr_decay_iters=1000), num_steps=5) == (1000, 10)
    with pytest.raises(ConfigError, match="not both"):
        decay_and_warmup_steps(_optim(lr_warmup_fraction=0.1, lr_warmup_iters=3), num_steps=5)


def test_unimplemented_style_raises() -> None:
    with pytest.raises(ConfigError, match="WSD"):
        lr_at(5, optim=_optim(lr_decay_style="WSD"), num_steps=10)
