"""AdamW with Megatron's parameter groups: biases and norm parameters get no weight decay."""

from __future__ import annotations

import torch
from torch import nn

from megatron_hpc.config.schema import OptimConfig
from megatron_hpc.parallel.device import apex_available


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


def build_optimizer(model: nn.Module, *, optim: OptimConfig) -> torch.optim.Optimizer:
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
