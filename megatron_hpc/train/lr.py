"""Learning-rate schedule: a pure function of the step, with Megatron's semantics.

shared/reference/megatron-and-launchers.md 4.2 (OptimizerParamScheduler.get_lr), in Megatron's order:
linear warmup from 0 to lr over the warmup steps; constant stays at lr; past lr_decay_iters the LR is
min_lr; inverse-square-root is lr * sqrt(warmup) / sqrt(step) floored at min_lr; linear and cosine
decay over [warmup, decay]; WSD (warmup-stable-decay) holds lr until the last
lr_wsd_decay_fraction * decay steps and then decays to min_lr in the lr_wsd_decay_style shape.
Megatron counts samples; with a fixed global batch that is the step count times GBS, so steps give
the same values.
"""

from __future__ import annotations

import math

from megatron_hpc.config.schema import OptimConfig
from megatron_hpc.errors import ConfigError


def decay_and_warmup_steps(optim: OptimConfig, *, num_steps: int) -> tuple[int, int]:
    """(decay steps, warmup steps) after applying the defaults and the warmup fraction."""
    decay = optim.lr_decay_iters if optim.lr_decay_iters is not None else num_steps
    if optim.lr_warmup_fraction is not None:
        if optim.lr_warmup_iters:
            raise ConfigError(f"set one of lr_warmup_iters ({optim.lr_warmup_iters}) and lr_warmup_fraction "
                              f"({optim.lr_warmup_fraction}), not both")
        warmup = int(optim.lr_warmup_fraction * decay)
    else:
        warmup = optim.lr_warmup_iters
    return decay, warmup


def wsd_decay_steps(optim: OptimConfig, *, decay: int) -> int:
    """Steps of WSD's final decay: lr_wsd_decay_fraction of the decay steps, at least one."""
    fraction = optim.lr_wsd_decay_fraction
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"optim.lr_wsd_decay_fraction must be in (0, 1], got {fraction}; 0.1 decays over "
                          f"the last 10% of lr_decay_iters")
    return max(1, int(fraction * decay))


def _wsd_coeff(ratio: float, *, style: str) -> float:
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ConfigError(f"lr_wsd_decay_style {style!r} is unknown; use linear, cosine, exponential or minus_sqrt")


def lr_at(step: int, *, optim: OptimConfig, num_steps: int) -> float:
    """Learning rate used by the optimizer step that follows `step` completed steps (0-based)."""
    decay, warmup = decay_and_warmup_steps(optim, num_steps=num_steps)
    max_lr, min_lr = optim.lr, optim.min_lr
    if warmup > 0 and step <= warmup:
        return max_lr * step / warmup
    style = optim.lr_decay_style
    if style == "constant":
        return max_lr
    if step > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(step, 1)))
    if style == "WSD":
        anneal = wsd_decay_steps(optim, decay=decay)
        start = decay - anneal
        coeff = 1.0 if step <= start else _wsd_coeff((step - start) / anneal, style=optim.lr_wsd_decay_style)
        return min_lr + coeff * (max_lr - min_lr)
    if decay <= warmup:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ConfigError(f"lr_decay_style {style!r} is unknown; use constant, linear, cosine, "
                          "inverse-square-root or WSD")
    return min_lr + coeff * (max_lr - min_lr)
