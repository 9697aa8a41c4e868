"""The optimizer seam: the few verbs train_step and the loop ask of an optimizer, and `build_optimizer`, which picks
one of the three implementations once, from the plan.

- PlainOptimizer (train/optim.py): AdamW whole on every DP rank, the gradients all-reduced over DP in buckets,
  optionally overlapped with the last backward (parallel/grads.py).
- DistributedOptimizer (train/distributed_optimizer.py): ZeRO-1 over flat buffers, each DP rank updating its slices,
  the gradients reduce-scattered and the weights all-gathered (parallel.distributed_optimizer off XLA).
- XlaZeroOptimizer (train/xla_zero.py): torch_xla's ZeRO-1 with fp32 master shards (the plan's fp32_master:
  parallel.distributed_optimizer on XLA).

What differs between them (where the gradients are reduced, what the norm counts, whether the skip of a non-finite
step is decided on the host or masked on the device, what is still in flight after the update) stays behind the
verbs, so train_step has no type or device branch (torchtitan's OptimizersContainer plays this part there).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.device import DeviceInfo
from megatron_hpc.plan.spec import RunSpec
from megatron_hpc.train.distributed_optimizer import DistributedOptimizer
from megatron_hpc.train.optim import PlainOptimizer
from megatron_hpc.train.xla_zero import XlaZeroOptimizer


class CheckpointedOptimizer(Protocol):
    """What train/checkpointing.py asks of an optimizer (a torch optimizer has it too)."""

    def state_dict(self) -> dict[str, Any]:
        """The plain AdamW layout (one entry per parameter, whole) on the ranks that write."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """This rank's part of a plain-layout state dict (saved at any DP size)."""

    def register_step_pre_hook(self, hook: Callable[..., None]) -> Any:
        """`hook` runs before every update writes the weights and moments (an asynchronous save's copy)."""


class TrainOptimizer(CheckpointedOptimizer, Protocol):
    """What a step and the loop ask of the optimizer, in the order a step asks it; and the checkpoint's part."""

    def before_forward(self) -> None:
        """The step's forward is next: wait for what the last update left in flight and no forward hook waits for
        (the distributed optimizer's parameter all-gathers)."""

    def zero_grad(self) -> None:
        """Clear the gradients before the first micro-batch's backward."""

    def mark_last_backward(self) -> None:
        """The next backward is the step's last: an overlapped gradient reduce starts inside it."""

    def reduce_and_clip(self, *, loss_scale: float = 1.0) -> torch.Tensor:
        """After every backward: reduce the gradients over DP, sum the sequence-parallel ones over TP, divide by
        `loss_scale` and clip to optim.clip_grad; the global norm before clipping (0-dim, on device, the same on
        every rank)."""

    def step_if_finite(self, finite: torch.Tensor) -> bool | None:
        """Update where `finite` (a device flag) holds; whether the update was skipped, or None where the flag
        stays on the device (XLA: the update is masked instead, and SkipTracker reads the flag a step later)."""

    def take_back_step(self) -> None:
        """AdamW's step count of a masked update that was not applied (XLA), once the host read the flag."""

    def set_lr(self, lr: float) -> None:
        """The LR of the next update."""

    def wait_for_weights(self) -> None:
        """The weights are the updated ones after this (a save, evaluation or the caller reads them next)."""


def build_optimizer(spec: RunSpec, ctx: ParallelContext, model: nn.Module, *, device: DeviceInfo,
                    compiled: bool = False) -> TrainOptimizer:
    """This rank's optimizer for `model`, as the plan says: ZeRO-1 with fp32 masters (the plan's fp32_master), the
    distributed optimizer (plan.distributed_optimizer), or the plain one.

    The overlapped reduce needs the last micro-batch's backward, which a pipeline schedule runs itself: not under
    pipelining. `compiled`: the model runs under torch.compile, which would trace the distributed optimizer's
    forward hooks, so its step waits for the gathers before the forward instead.
    """
    plan, parallel = spec.plan, spec.config.parallel
    pipelined = ctx.pp_size > 1
    if plan.fp32_master:
        if parallel.overlap_param_gather and ctx.is_first_rank:
            print("megatron-hpc: warning: parallel.overlap_param_gather ignored on XLA: torch_xla's ZeRO-1 "
                  "all-gathers inside the step's graph, where the compiler schedules it", file=sys.stderr, flush=True)
        return XlaZeroOptimizer(model, optim=spec.config.optim, ctx=ctx)
    if plan.distributed_optimizer:
        optimizer = DistributedOptimizer(model, optim=spec.config.optim, ctx=ctx, bucket_mb=parallel.grad_bucket_mb,
                                         overlap=parallel.overlap_grad_reduce and not pipelined,
                                         overlap_param_gather=parallel.overlap_param_gather and not pipelined)
        if not compiled:
            optimizer.wait_in_forward(model)
        return optimizer
    return PlainOptimizer(model, optim=spec.config.optim, ctx=ctx, device_kind=device.kind,
                          overlap=parallel.overlap_grad_reduce and not pipelined, bucket_mb=parallel.grad_bucket_mb)
