"""Learning-rate schedule: a pure function of the successful steps, with Megatron's semantics.

shared/reference/megatron-and-launchers.md 4.2 (OptimizerParamScheduler.get_lr), in Megatron's order:
linear warmup from 0 to lr over the warmup steps; constant stays at lr; past the decay steps the LR is
min_lr; inverse-square-root is lr * sqrt(warmup) / sqrt(step) floored at min_lr; linear and cosine
decay over [warmup, decay]; WSD (warmup-stable-decay) holds lr until the last
lr_wsd_decay_fraction * decay steps and then decays to min_lr in the lr_wsd_decay_style shape.

The schedule advances only on steps whose update was applied: Megatron calls
`opt_param_scheduler.step(increment=global batch)` only when `update_successful`, so a step skipped
for fp16 overflow or a non-finite gradient leaves the LR where it was. Callers pass the count of
successful steps, which a checkpoint carries (lr_scheduler.successful_steps; num_steps in samples).

The unit follows the config, as in Megatron: with lr_warmup_samples / lr_decay_samples the schedule is
counted in samples (successful steps * global batch size); otherwise in iterations. With a fixed
global batch both give the same LR, except that inverse-square-root without warmup divides by the
square root of the count in the schedule's own unit.
"""

from __future__ import annotations

import math

from megatron_hpc.config.schema import OptimConfig
from megatron_hpc.errors import ConfigError
from megatron_hpc.plan.lr_schedule import LrSchedule, decay_and_warmup_steps, resolve_schedule

__all__ = ["LrSchedule", "decay_and_warmup_steps", "lr_at", "lr_at_count", "resolve_schedule"]


def wsd_decay_steps(optim: OptimConfig, *, decay: int) -> int:
    """Length of WSD's final decay: lr_wsd_decay_fraction of the decay length, at least one (same unit)."""
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


def lr_at(step: int, *, optim: OptimConfig, num_steps: int, global_batch_size: int | None = None) -> float:
    """LR of the optimizer step that follows `step` successful (not skipped) steps.

    global_batch_size is needed only when the schedule is given in samples.
    """
    sched = resolve_schedule(optim, num_steps=num_steps, global_batch_size=global_batch_size)
    return lr_at_count(step * sched.per_step, sched=sched, optim=optim)


def lr_at_count(count: int, *, sched: LrSchedule, optim: OptimConfig) -> float:
    """Megatron's get_lr at scheduler count `count` (iterations or samples, as `sched` says)."""
    decay, warmup = sched.decay, sched.warmup
    max_lr, min_lr = optim.lr, optim.min_lr
    if warmup > 0 and count <= warmup:
        return max_lr * count / warmup
    style = optim.lr_decay_style
    if style == "constant":
        return max_lr
    if count > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(count, 1)))
    if style == "WSD":
        anneal = wsd_decay_steps(optim, decay=decay)
        start = decay - anneal
        coeff = 1.0 if count <= start else _wsd_coeff((count - start) / anneal, style=optim.lr_wsd_decay_style)
        return min_lr + coeff * (max_lr - min_lr)
    if decay <= warmup:
        return min_lr
    ratio = (count - warmup) / (decay - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ConfigError(f"lr_decay_style {style!r} is unknown; use constant, linear, cosine, "
                          "inverse-square-root or WSD")
    return min_lr + coeff * (max_lr - min_lr)
