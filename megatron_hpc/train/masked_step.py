"""An optimizer step applied only where a device flag says the gradients were finite, without a branch in the graph
(XLA keeps the flag on the device; reading it would be a host sync every step). Used by the plain optimizer on XLA
(train/optim.py) and by the XLA distributed optimizer on its fp32 shards (train/xla_zero.py)."""

from __future__ import annotations

import torch


@torch.no_grad()
def step_where(optimizer: torch.optim.Optimizer, finite: torch.Tensor) -> None:
    """optimizer.step() where `finite` (a device flag) holds, a no-op elsewhere, with no branch in the graph.

    The update always runs; a select then keeps each parameter's and each state tensor's old value when the flag
    is false. On XLA the old values are buffers the step graph reads anyway, so keeping them costs no copy. State
    created by this very step starts from zeros, as AdamW's does. AdamW's step count is left out: it stays on the
    host (on the device it would be bf16 under XLA_USE_BF16, where 0.999 rounds to 1 and counts above 256 are
    inexact), so it advances here and SkipTracker (train/step.py) takes it back once the host has read the flag.
    """
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    old = [(p.detach().clone(), {k: v.detach().clone() for k, v in optimizer.state[p].items() if _selected(k, v)})
           for p in params]
    optimizer.step()
    for p, (old_p, old_state) in zip(params, old):
        p.copy_(torch.where(finite, p, old_p))
        for key, value in optimizer.state[p].items():
            if _selected(key, value):
                before = old_state.get(key)
                value.copy_(torch.where(finite, value, before if before is not None else torch.zeros_like(value)))


def _selected(key: str, value: object) -> bool:
    return key != "step" and torch.is_tensor(value)


def take_back_step(optimizer: torch.optim.Optimizer) -> None:
    """Take back AdamW's step count of a step that `step_where` did not apply (SkipTracker, train/step.py, once the
    host has read the flag)."""
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] -= 1
