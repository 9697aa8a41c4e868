"""ResumeState: everything besides the weights and the optimizer that a resumed run needs.

The RNG keys follow the reference Megatron (neuron-xla.md 1.3): random_rng_state, np_rng_state,
torch_rng_state, cuda_rng_state; ours beside them: xla_rng_state, torch_xla's running seed, which draws the
dropout masks on XLA (the reference's cuda_rng_state is the CPU state under another name, so it had none).
xser turns tuples into lists, so states are stored as lists and turned back into tuples on restore (the
reference's "Converting random rng state from list to tuple").
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


@dataclass(frozen=True, kw_only=True)
class ResumeState:
    step: int
    """Optimizer steps taken (Megatron's iteration)."""
    consumed_samples: int
    """Training samples consumed across all DP ranks."""
    python_rng: list
    """random.getstate() as nested lists."""
    numpy_rng: list
    """np.random.get_state() as [name, keys (list of int), pos, has_gauss, cached_gaussian]."""
    torch_rng: torch.Tensor
    """torch.get_rng_state() (CPU generator)."""
    cuda_rng: list[torch.Tensor] | None = None
    """One state per CUDA device, None off CUDA."""
    xla_rng: list[int] | None = None
    """torch_xla's RNG state (running seed) of the worker's XLA device, None off XLA."""

    @classmethod
    def capture(cls, *, step: int, consumed_samples: int, device: DeviceInfo) -> ResumeState:
        version, internal, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state()
        return cls(step=step, consumed_samples=consumed_samples,
                   python_rng=[version, list(internal), gauss],
                   numpy_rng=[str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
                   torch_rng=torch.get_rng_state(), cuda_rng=accelerator_rng_state(device),
                   xla_rng=xla_rng_state(device))

    def restore_rng(self, device: DeviceInfo) -> None:
        version, internal, gauss = self.python_rng
        random.setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = self.numpy_rng
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(self.torch_rng)
        set_accelerator_rng_state(device, self.cuda_rng)
        set_xla_rng_state(device, self.xla_rng)

    def rng_dict(self) -> dict[str, Any]:
        """The reference Megatron's RNG keys, and ours for XLA."""
        return {"random_rng_state": self.python_rng, "np_rng_state": self.numpy_rng,
                "torch_rng_state": self.torch_rng, "cuda_rng_state": self.cuda_rng, "xla_rng_state": self.xla_rng}

    @classmethod
    def from_rng_dict(cls, rng: dict[str, Any], *, step: int, consumed_samples: int) -> ResumeState:
        try:
            return cls(step=int(step), consumed_samples=int(consumed_samples), python_rng=list(rng["random_rng_state"]),
                       numpy_rng=list(rng["np_rng_state"]), torch_rng=rng["torch_rng_state"],
                       cuda_rng=rng.get("cuda_rng_state"), xla_rng=rng.get("xla_rng_state"))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"the checkpoint's RNG state is incomplete ({type(exc).__name__}: {exc}); "
                                  "it was not written by megatron-hpc or is damaged") from None
