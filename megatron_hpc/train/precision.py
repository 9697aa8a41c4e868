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
from collections.abc import MutableMapping
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


def set_xla_precision_env(precision: str, *, fp32_master: bool = False,
                          environ: MutableMapping[str, str] | None = None) -> str | None:
    """Make the XLA variables say what train.precision says; call before torch_xla reads them (its first tensor).

    bf16: XLA_USE_BF16=1 unless one of the two is on already, the reference's pure bf16 with the Neuron runtime's
    stochastic rounding (neuron-xla.md 4.6). fp32, or bf16 with `fp32_master` (the distributed optimizer on
    XLA: the plan's fp32_master): both cleared, since either one silently makes every float bf16 while the tensors
    still report float32, the fp32 masters and Adam moments included; with fp32_master the trainer casts the model
    weights to bf16 itself (train/xla_zero.py). Returns a warning when it overrode what the environment said.
    """
    env = os.environ if environ is None else environ
    on = {k: env[k] for k in XLA_PURE_BF16_ENV if env.get(k, "0") not in ("", "0")}
    if precision == "bf16" and not fp32_master:
        if not on:
            env["XLA_USE_BF16"] = "1"
        return None
    for key in XLA_PURE_BF16_ENV:
        env.pop(key, None)
    if not on:
        return None
    settings = " and ".join(f"{k}={v}" for k, v in on.items())
    they, them = ("they", "them") if len(on) > 1 else ("it", "it")
    if fp32_master:
        return (f"{settings} ignored: parallel.distributed_optimizer keeps fp32 master weights, which {they} would "
                f"make bf16 on the device, so the trainer cleared {them}; the model weights are bf16 all the same")
    return (f"{settings} ignored: train.precision is {precision} and {they} would make "
            f"every float bf16 on the device, so the trainer cleared {them}; "
            f"set train.precision=bf16 to train in bf16")


def autocast_dtype_for(precision: str, *, device_kind: str, float_dtype: torch.dtype = torch.float32,
                       fp32_master: bool = False) -> torch.dtype | None:
    """The autocast dtype for train.precision on this device; None means none (fp32, or bf16 weights on XLA).

    float_dtype is what the device really holds a float32 tensor as (DeviceInfo.float_dtype).
    """
    if precision == "fp32":
        return None
    if precision == "bf16":
        if device_kind == "xla" and fp32_master:
            # The model weights are bf16 tensors (train/xla_zero.py): the forward computes in bf16 as pure bf16's
            # does, so the two differ only in the masters and Adam state.
            return None
        if device_kind == "xla" and float_dtype == torch.bfloat16:
            # XLA_USE_BF16=1 made every float bf16, with the Neuron runtime's stochastic rounding (the reference's
            # pure bf16, neuron-xla.md 4.6): autocast would only add casts. A torch-xla that ignores the variable
            # leaves float32 on the device, and then autocast gives the bf16 matmuls.
            return None
        return torch.bfloat16
    if precision == "fp16":
        if device_kind == "xla":
            raise TrainingError("train.precision fp16 is not supported on XLA (Trainium has no fp16 loss-scaling "
                                "path here); use bf16, which the Neuron reference uses")
        return torch.float16
    raise TrainingError(f"train.precision {precision!r} is unknown; use fp32, bf16 or fp16")


def compute_label(precision: str, *, float_dtype: torch.dtype, autocast_dtype: torch.dtype | None,
                  fp32_master: bool = False) -> str:
    """What the device computes, for the banner: 'fp32', 'bf16 (pure: ...)', 'bf16 (autocast, fp32 weights)'."""
    if fp32_master:
        weights = "bf16" if precision == "bf16" else "fp32"
        return f"{weights} ({weights} weights, fp32 master weights and Adam state)"
    if float_dtype == torch.bfloat16:
        return "bf16 (pure: every float is bf16 on the device, weights and Adam state included)"
    if autocast_dtype is not None:
        name = "bf16" if autocast_dtype == torch.bfloat16 else "fp16"
        return f"{name} (autocast, fp32 weights and Adam state{', loss scaling' if name == 'fp16' else ''})"
    return "fp32"


def build_loss_scaler(precision: str) -> DynamicGradScaler | None:
    """A dynamic loss scaler for fp16; fp32 and bf16 need none (their range is fp32's)."""
    return DynamicGradScaler() if precision == "fp16" else None
