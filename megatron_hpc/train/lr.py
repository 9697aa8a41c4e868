"""Learning-rate schedule: a pure function of the step, with Megatron's semantics.

shared/reference/megatron-and-launchers.md 4.2 (OptimizerParamScheduler.get_lr): linear warmup
from 0 to lr over the warmup steps, then constant, linear or cosine decay to min_lr over
lr_decay_iters, then min_lr. Megatron counts samples; with a fixed global batch that is the
step count times GBS, so steps give the same values.
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


def lr_at(step: int, *, optim: OptimConfig, num_steps: int) -> float:
    """Learning rate used by the optimizer step that follows `step` completed steps (0-based)."""
    decay, warmup = decay_and_warmup_steps(optim, num_steps=num_steps)
    max_lr, min_lr = optim.lr, optim.min_lr
    if warmup > 0 and step <= warmup:
        return max_lr * step / warmup
    style = optim.lr_decay_style
    if style == "constant":
        return max_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(step, 1)))
    if step > decay:
        return min_lr
    if decay <= warmup:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ConfigError(f"lr_decay_style {style!r} is not implemented yet; use constant, linear, cosine "
                          "or inverse-square-root")
    return min_lr + coeff * (max_lr - min_lr)
