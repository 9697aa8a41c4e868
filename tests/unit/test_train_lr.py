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


def test_wsd_holds_then_decays_in_the_last_fraction() -> None:
    # decay 100 steps, warmup 10, last 20% (20 steps) decay: stable over (10, 80], decay over (80, 100].
    for style in ("linear", "cosine", "exponential", "minus_sqrt"):
        optim = _optim(lr_decay_style="WSD", lr_warmup_iters=10, lr_decay_iters=100, lr_wsd_decay_fraction=0.2,
                       lr_wsd_decay_style=style)
        assert lr_at(5, optim=optim, num_steps=100) == pytest.approx(LR / 2)
        assert [lr_at(s, optim=optim, num_steps=100) for s in (11, 50, 80)] == [LR] * 3
        for step in (81, 85, 90, 99, 100):
            r = (step - 80) / 20
            coeff = {"linear": 1 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1),
                     "exponential": 2 * 0.5 ** r - 1, "minus_sqrt": 1 - math.sqrt(r)}[style]
            assert lr_at(step, optim=optim, num_steps=100) == pytest.approx(MIN_LR + coeff * (LR - MIN_LR))
        assert lr_at(100, optim=optim, num_steps=100) == pytest.approx(MIN_LR)
        assert lr_at(101, optim=optim, num_steps=120) == MIN_LR


def test_wsd_default_fraction_and_bad_fraction() -> None:
    optim = _optim(lr_decay_style="WSD", lr_wsd_decay_style="linear", lr_decay_iters=1000)
    assert optim.lr_wsd_decay_fraction == 0.1
    assert lr_at(900, optim=optim, num_steps=1000) == LR
    assert lr_at(950, optim=optim, num_steps=1000) == pytest.approx(MIN_LR + 0.5 * (LR - MIN_LR))
    with pytest.raises(ConfigError, match="lr_wsd_decay_fraction"):
        lr_at(5, optim=_optim(lr_decay_style="WSD", lr_wsd_decay_fraction=0.0), num_steps=10)


def test_inverse_square_root_as_megatron() -> None:
    optim = _optim(lr_decay_style="inverse-square-root", lr_warmup_iters=16, lr_decay_iters=1000)
    assert lr_at(8, optim=optim, num_steps=1000) == pytest.approx(LR / 2)  # warmup
    assert lr_at(64, optim=optim, num_steps=1000) == pytest.approx(LR * 4 / 8)
    assert lr_at(400, optim=optim, num_steps=1000) == pytest.approx(LR * 4 / 20)
    assert lr_at(1000, optim=optim, num_steps=1000) == pytest.approx(max(MIN_LR, LR * 4 / math.sqrt(1000)))
    assert lr_at(1001, optim=optim, num_steps=2000) == MIN_LR  # past the decay steps: min_lr, as Megatron
    no_warmup = _optim(lr_decay_style="inverse-square-root", lr_decay_iters=100)
    assert lr_at(0, optim=no_warmup, num_steps=100) == LR
    assert lr_at(25, optim=no_warmup, num_steps=100) == pytest.approx(LR / 5)
