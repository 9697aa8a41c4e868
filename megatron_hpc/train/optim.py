"""AdamW with Megatron's parameter groups (biases and norm parameters get no weight decay), and the plain optimizer:
AdamW whole on every DP rank, its gradients all-reduced over DP (parallel/grads.py).

The plain optimizer is one of the three behind train/optimizer.py's seam; the other two shard Adam's state over DP
(train/distributed_optimizer.py, train/xla_zero.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megatron_hpc.config.schema import OptimConfig
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.device import apex_available
from megatron_hpc.parallel.grads import (
    BUCKET_MB,
    all_reduce_gradients,
    all_reduce_sequence_parallel_grads,
    build_grad_reducer,
    clip_gradients_,
)
from megatron_hpc.train.masked_step import step_where, take_back_step


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """Two groups: matrices (embeddings, linear weights) decay; 1-D params (biases, norms) do not."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        # Megatron's rule (get_param_groups): no decay for biases and norm weights, all 1-D.
        (no_decay if param.ndim < 2 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(model: nn.Module, *, optim: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the local shards; the LR is set by the loop before every step.

    apex's FusedAdam (AdamW mode) on CUDA when apex imports; otherwise torch's fused AdamW, one
    kernel for all parameters, on CPU and CUDA; the plain implementation on XLA, whose compiler
    fuses the update itself.
    """
    groups = param_groups(model, weight_decay=optim.weight_decay)
    kwargs = dict(lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps)
    kind = next(model.parameters()).device.type
    if kind == "cuda" and apex_available():
        from apex.optimizers import FusedAdam

        return FusedAdam(groups, adam_w_mode=True, **kwargs)
    return torch.optim.AdamW(groups, fused=kind in ("cpu", "cuda"), **kwargs)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class PlainOptimizer:
    """AdamW over this rank's whole parameters, the same on every DP rank: the gradients are averaged over DP in
    buckets, started inside the last micro-batch's backward with `overlap` (OverlappedGradReducer, not on XLA and not
    with one DP rank: build_grad_reducer) or all-reduced after backward.

    Off XLA a non-finite gradient norm skips the update after one host read of the flag; on XLA the flag stays on the
    device and `step_where` (train/masked_step.py) keeps the old weights and moments where it is false.
    """

    def __init__(self, model: nn.Module, *, optim: OptimConfig, ctx: ParallelContext, device_kind: str,
                 overlap: bool = False, bucket_mb: float = BUCKET_MB):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_adamw(model, optim=optim)
        self.ctx, self.clip_grad, self.bucket_mb = ctx, optim.clip_grad, bucket_mb
        self.on_xla = device_kind == "xla"
        self.reducer = build_grad_reducer(self.params, group=ctx.dp_group, overlap=overlap, bucket_mb=bucket_mb,
                                          device_kind=device_kind)
        """None: the DP all-reduce runs after backward."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        # Off XLA the first backward assigns the gradients (no zero fill, no add); on XLA zero in place so that the
        # graph keeps one shape (neuron-xla.md 3.3).
        self.optimizer.zero_grad(set_to_none=not self.on_xla)

    def before_forward(self) -> None:
        """Nothing to wait for: every rank holds its whole weights."""

    def mark_last_backward(self) -> None:
        """The next backward is the step's last: the overlapped reducer starts each bucket as soon as it is final."""
        if self.reducer is not None:
            self.reducer.arm()

    def reduce_and_clip(self, *, loss_scale: float = 1.0) -> torch.Tensor:
        """Average the gradients over DP, sum the sequence-parallel ones over TP, unscale and clip them to the
        global norm optim.clip_grad (0: no clip); the norm before clipping (0-dim, on device)."""
        if self.reducer is not None:
            self.reducer.finish()
        else:
            all_reduce_gradients(self.params, group=self.ctx.dp_group, bucket_mb=self.bucket_mb)
        # Sequence parallelism: replicated params' grads are partial per TP rank (no-op without tagged params).
        # After the DP reduce, whose overlapped buckets copy back into .grad, and after a pipeline schedule, which
        # ran every backward before this.
        all_reduce_sequence_parallel_grads(self.params, group=self.ctx.tp_group)
        if loss_scale != 1.0:
            torch._foreach_mul_([p.grad for p in self.params if p.grad is not None], 1.0 / loss_scale)
        return clip_gradients_(self.params, max_norm=self.clip_grad, ctx=self.ctx)

    def step_if_finite(self, finite: torch.Tensor) -> bool | None:
        """AdamW where `finite` holds; whether the step was skipped (None on XLA, where the flag stays on the
        device)."""
        if self.on_xla:
            step_where(self.optimizer, finite)
            return None
        skipped = not bool(finite.item())  # host sync: the skip decision
        if not skipped:
            self.optimizer.step()
        return skipped

    def take_back_step(self) -> None:
        take_back_step(self.optimizer)

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def wait_for_weights(self) -> None:
        """Nothing in flight: the update wrote the weights."""

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def register_step_pre_hook(self, hook: Callable[..., None]) -> Any:
        return self.optimizer.register_step_pre_hook(hook)
