"""Mixed precision: the autocast dtype of a run and Megatron's dynamic loss scaler for fp16.

fp16 runs the forward under autocast(float16) (activations in fp16, fp32 master weights and Adam
state, as torch AMP and Megatron's Float16OptimizerWithFloat16Params keep them). The loss is
multiplied by the scale before backward and the gradients divided by it afterwards; a step whose
gradients are not finite is skipped and the scale backs off.

DynamicGradScaler semantics are Megatron's (megatron/core/optimizer/grad_scaler.py, defaults from
--initial-loss-scale 2**32, --loss-scale-window 1000, --hysteresis 2, --min-loss-scale 1): an
overflow resets the growth count and spends one unit of hysteresis; once hysteresis is spent,
every overflow halves the scale (not below the minimum). After `growth_interval` finite steps in
a row the scale doubles and the hysteresis is refilled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megatron_hpc.errors import TrainingError


@dataclass(kw_only=True, slots=True)
class DynamicGradScaler:
    scale: float = 2.0**32
    """Current loss scale (a host float: the overflow check that drives it is a host sync anyway)."""
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    growth_tracker: int = 0
    """Finite steps since the last overflow or growth."""
    hysteresis_tracker: int = 2
    """Overflows still tolerated before the scale backs off."""

    def update(self, *, found_inf: bool) -> None:
        """Adjust the scale after a step whose gradients were (not) finite."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, float | int]:
        """What a checkpoint keeps (Megatron: scale, growth_tracker, hysteresis_tracker)."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


XLA_PURE_BF16_ENV = ("XLA_USE_BF16", "XLA_DOWNCAST_BF16")


def autocast_dtype_for(precision: str, *, device_kind: str) -> torch.dtype | None:
    """The autocast dtype for train.precision on this device; None means none (fp32, or pure bf16 on XLA)."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        if device_kind == "xla" and any(os.environ.get(k) == "1" for k in XLA_PURE_BF16_ENV):
            # The platform's XLA_USE_BF16=1 makes every float bf16, with the Neuron runtime's stochastic
            # rounding (the reference's pure bf16, neuron-xla.md 4.6): autocast would only add casts.
            return None
        return torch.bfloat16
    if precision == "fp16":
        if device_kind == "xla":
            raise TrainingError("train.precision fp16 is not supported on XLA (Trainium has no fp16 loss-scaling "
                                "path here); use bf16, which the Neuron reference uses")
        return torch.float16
    raise TrainingError(f"train.precision {precision!r} is unknown; use fp32, bf16 or fp16")


def build_loss_scaler(precision: str) -> DynamicGradScaler | None:
    """A dynamic loss scaler for fp16; fp32 and bf16 need none (their range is fp32's)."""
    return DynamicGradScaler() if precision == "fp16" else None
