"""The LR schedule's unit and lengths, resolved from the optim section and the run length. Pure.

The planner resolves them once (plan.json: lr_schedule_unit, lr_warmup, lr_decay), so a schedule that mixes
iterations and samples is refused before anything is queued, and the trainer reads the lengths from the plan.
The LR at a given count is train/lr.py (Megatron's get_lr).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_hpc.config.schema import OptimConfig
from megatron_hpc.errors import ConfigError


@dataclass(frozen=True, slots=True)
class LrSchedule:
    """The schedule's lengths in its own unit (iterations or samples)."""

    per_step: int
    """Count added by one successful step: 1 (iterations) or the global batch size (samples)."""
    warmup: float
    """Warmup length (a fraction of the decay length need not be whole, as in Megatron)."""
    decay: int
    """Decay length; past it the LR is min_lr."""


def decay_and_warmup_steps(optim: OptimConfig, *, num_steps: int) -> tuple[int, float]:
    """(decay steps, warmup steps) of an iteration-counted schedule, after the defaults and the fraction."""
    decay = optim.lr_decay_iters if optim.lr_decay_iters is not None else num_steps
    if optim.lr_warmup_fraction is not None:
        if optim.lr_warmup_iters:
            raise ConfigError(f"set one of lr_warmup_iters ({optim.lr_warmup_iters}) and lr_warmup_fraction "
                              f"({optim.lr_warmup_fraction}), not both")
        return decay, optim.lr_warmup_fraction * decay  # Megatron keeps the product unrounded
    return decay, optim.lr_warmup_iters


def counts_samples(optim: OptimConfig) -> bool:
    """Whether the schedule is given (and counted) in samples."""
    return bool(optim.lr_warmup_samples) or optim.lr_decay_samples is not None


def resolve_schedule(optim: OptimConfig, *, num_steps: int, global_batch_size: int | None) -> LrSchedule:
    """The schedule's unit and lengths; ConfigError when iterations and samples are mixed."""
    if not counts_samples(optim):
        decay, warmup = decay_and_warmup_steps(optim, num_steps=num_steps)
        return LrSchedule(per_step=1, warmup=warmup, decay=decay)
    given = {"lr_warmup_iters": optim.lr_warmup_iters, "lr_decay_iters": optim.lr_decay_iters}
    mixed = {k: v for k, v in given.items() if v}
    if mixed:
        raise ConfigError(f"optim.{next(iter(mixed))}={next(iter(mixed.values()))} mixes iterations into a "
                          f"schedule given in samples (lr_warmup_samples {optim.lr_warmup_samples}, "
                          f"lr_decay_samples {optim.lr_decay_samples}); give warmup and decay both in samples")
    if optim.lr_warmup_fraction is not None and optim.lr_warmup_samples:
        raise ConfigError(f"set one of lr_warmup_samples ({optim.lr_warmup_samples}) and lr_warmup_fraction "
                          f"({optim.lr_warmup_fraction}), not both")
    if global_batch_size is None:
        raise ConfigError("an LR schedule in samples needs the global batch size; pass global_batch_size")
    decay = optim.lr_decay_samples if optim.lr_decay_samples is not None else num_steps * global_batch_size
    warmup = (optim.lr_warmup_fraction * decay if optim.lr_warmup_fraction is not None
              else optim.lr_warmup_samples)
    return LrSchedule(per_step=global_batch_size, warmup=warmup, decay=decay)
