"""A checkpoint's optimizer state by parameter name, so Adam's moments follow their weights across a TP or PP
reshard, and into a model that orders its parameters differently. Pure: dicts in, dicts out.

torch numbers an optimizer's state by position. The trainer's AdamW has two groups (train/optim.py
param_groups): the matrices (weight decay), then the 1-D tensors (no decay), each in the model's parameter order.
The checkpoint's `model` dict is model.state_dict(), which lists the parameters in that same order (our GPT has no
persistent buffers), so position i of the optimizer is the i-th name of param_order(model).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

Moments = dict[str, Any]
"""One parameter's optimizer state (AdamW: step, exp_avg, exp_avg_sq)."""


def param_order(model: dict[str, torch.Tensor]) -> list[str]:
    """The names in the optimizer's order: matrices first, then 1-D tensors, each in the model dict's order."""
    names = list(model)
    return [n for n in names if model[n].ndim >= 2] + [n for n in names if model[n].ndim < 2]


def group_template(optimizer: dict[str, Any], model: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """The two param groups' settings (lr, betas, weight decay, ...) without their parameter ids; ValueError when
    the groups are not the trainer's two (matrices, then 1-D tensors) of this model."""
    groups = optimizer["param_groups"]
    matrices = sum(1 for t in model.values() if t.ndim >= 2)
    sizes = [len(g["params"]) for g in groups]
    if sizes != [matrices, len(model) - matrices]:
        raise ValueError(f"optimizer groups of {sizes} parameters for a model of {matrices} matrices and "
                         f"{len(model) - matrices} 1-D tensors")
    return [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in groups]


def by_name(model: dict[str, torch.Tensor], optimizer: dict[str, Any]) -> dict[str, Moments]:
    """Each stepped parameter's state, by name (a parameter never stepped has none)."""
    group_template(optimizer, model)  # the counts must match before positions mean names
    ids = [i for g in optimizer["param_groups"] for i in g["params"]]
    state = optimizer["state"]
    return {name: state[i] for i, name in zip(ids, param_order(model)) if i in state}


def indexed(moments: dict[str, Moments], *, model: dict[str, torch.Tensor],
            groups: list[dict[str, Any]]) -> dict[str, Any]:
    """An optimizer state_dict for `model` (what optimizer.load_state_dict takes) from moments by name."""
    order = param_order(model)
    matrices = sum(1 for t in model.values() if t.ndim >= 2)
    bounds = [(0, matrices), (matrices, len(order))]
    return {"state": {i: moments[name] for i, name in enumerate(order) if name in moments},
            "param_groups": [{**copy.deepcopy(g), "params": list(range(a, b))} for g, (a, b) in zip(groups, bounds)]}


def for_model(optimizer: dict[str, Any], *, saved_model: dict[str, torch.Tensor],
              live_model: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`optimizer`, saved beside `saved_model`, renumbered for a model whose parameters come in `live_model`'s
    order (the same names): unchanged when the orders agree. A resharded checkpoint lists each pipeline rank's
    weights in the PP=1 model's order; a stage module may list them otherwise."""
    if list(saved_model) == list(live_model):
        return optimizer
    if set(saved_model) != set(live_model):
        raise ValueError("the checkpoint's model holds other weights than this model")
    return indexed(by_name(saved_model, optimizer), model=live_model,
                   groups=group_template(optimizer, saved_model))


def with_masters(optimizer: dict[str, Any], *, model: dict[str, torch.Tensor], key: str) -> dict[str, Any]:
    """`optimizer` (positions in `model`'s order) with each fp32 weight of `model` as its parameter's master copy
    under `key` where the state has none. `ckpt convert` writes a 16-bit run's fp32 masters as the weights
    (checkpoint/foreign/importer.py), with no separate master; an optimizer that keeps fp32 masters beside bf16 weights
    (train/xla_zero.py) must start from those, not from the bf16 rounding of them its parameters hold."""
    ids = [i for g in optimizer["param_groups"] for i in g["params"]]
    state = dict(optimizer["state"])
    for i, name in zip(ids, param_order(model)):
        weight = model[name]
        if i in state and key not in state[i] and weight.dtype == torch.float32:
            state[i] = {**state[i], key: weight}
    return {**optimizer, "state": state}
