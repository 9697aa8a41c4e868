"""TrainState: everything besides weights and optimizer that a resumed run needs, in one dataclass.

The loop owns one TrainState and advances it after every step; the Checkpointer saves it and restores it.
RNG states use the reference Megatron's keys (neuron-xla.md 1.3): random_rng_state, np_rng_state,
torch_rng_state, cuda_rng_state. xser turns tuples into lists, so states are stored as lists and turned back
into tuples on restore (the reference's "Converting random rng state from list to tuple").
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_hpc.errors import CheckpointError
from megatron_hpc.parallel.device import (
    DeviceInfo,
    accelerator_rng_state,
    set_accelerator_rng_state,
    set_xla_rng_state,
    xla_rng_state,
)
from megatron_hpc.train.precision import DynamicGradScaler


@dataclass(frozen=True, kw_only=True)
class RngState:
    python: list
    """random.getstate() as nested lists."""
    numpy: list
    """np.random.get_state() as [name, keys (list of int), pos, has_gauss, cached_gaussian]."""
    torch_cpu: torch.Tensor
    """torch.get_rng_state() (CPU generator)."""
    accelerator: list[torch.Tensor] | None = None
    """One state per CUDA device; None off CUDA."""
    xla: list[int] | None = None
    """torch_xla's RNG state (its running seed) of the worker's XLA device, which draws the dropout masks there;
    None off XLA. Saved as xla_rng_state (the reference's cuda_rng_state is the CPU state under another name)."""

    @classmethod
    def capture(cls, device: DeviceInfo) -> RngState:
        version, internal, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state()
        return cls(python=[version, list(internal), gauss],
                   numpy=[str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
                   torch_cpu=torch.get_rng_state(), accelerator=accelerator_rng_state(device),
                   xla=xla_rng_state(device))

    def restore(self, device: DeviceInfo) -> None:
        version, internal, gauss = self.python
        random.setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = self.numpy
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(self.torch_cpu)
        set_accelerator_rng_state(device, self.accelerator)
        set_xla_rng_state(device, self.xla)

    def to_megatron(self) -> dict[str, Any]:
        return {"random_rng_state": self.python, "np_rng_state": self.numpy,
                "torch_rng_state": self.torch_cpu, "cuda_rng_state": self.accelerator, "xla_rng_state": self.xla}

    @classmethod
    def from_megatron(cls, rng: dict[str, Any], *, where: object) -> RngState:
        try:
            return cls(python=list(rng["random_rng_state"]), numpy=list(rng["np_rng_state"]),
                       torch_cpu=rng["torch_rng_state"], accelerator=rng.get("cuda_rng_state"),
                       xla=rng.get("xla_rng_state"))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"the RNG state in {where} is incomplete ({type(exc).__name__}: {exc}); it was "
                                  "not written by megatron-hpc or is damaged") from None


@dataclass(kw_only=True)
class TrainState:
    """Where the run is; the loop advances it, checkpoints carry it."""

    step: int = 0
    """Optimizer steps taken (Megatron's iteration)."""
    consumed_samples: int = 0
    """Training samples consumed across all DP ranks."""
    lr_steps: int = 0
    """Steps whose update was applied: the LR schedule advances only on those (Megatron's update_successful)."""
    scaler: DynamicGradScaler | None = None
    """fp16's dynamic loss scaler (its scale and trackers are state too); None for fp32 and bf16."""
    rng: RngState | None = None
    """The RNG states: set when restored from a checkpoint (and captured at each save)."""

    def advance(self, *, global_batch_size: int) -> None:
        """Count one optimizer step over a global batch (train/step.py SkipTracker counts lr_steps: whether the
        update was applied is known one step late on XLA)."""
        self.step += 1
        self.consumed_samples += global_batch_size
