"""A Megatron-family optimizer state by parameter name: Adam's moments and fp32 master weights. Pure.

What the files hold (shared/reference/neuron-xla.md 1.3; Megatron's optimizer/optimizer.py state_dict):
- fp32 training: the Adam optimizer's own state_dict, {'state': {position: {step, exp_avg, exp_avg_sq}},
  'param_groups': [...]};
- fp16 / bf16 (Float16OptimizerWithFloat16Params): {'optimizer': that state_dict, 'grad_scaler': {...},
  'fp32_from_fp16_params': [[fp32 master of each parameter of group 0], [... group 1]]};
- the distributed optimizer keeps only its settings here and its moments in distrib_optim.pt, flattened by
  bucket: read by distrib_optim.py.

Positions follow Megatron's parameter groups: weights with weight decay (every matrix), then the LayerNorms and
biases without, each in the model's parameter order (`_get_params_for_weight_decay_optimization`); megatron-core
builds the same two groups but starts with whichever the stage's first parameter belongs to. Both orders are tried
and kept only when every moment has its parameter's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

Moments = dict[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class ForeignOptimizer:
    moments: dict[str, Moments]
    """Each stepped parameter's {step, exp_avg, exp_avg_sq}; step is None when the file keeps one per group."""
    masters: dict[str, torch.Tensor]
    """fp32 master weights by name (empty for fp32 training)."""
    hyper: dict[str, Any]
    """lr, betas, eps and weight_decay of the decay group."""
    grad_scaler: dict[str, Any] | None


def _parts(optimizer: Any) -> tuple[dict[str, Any], list[Any] | None, dict[str, Any] | None]:
    """(the torch optimizer state_dict, the fp32 master groups, the grad scaler state); ValueError with the reason
    when the value is none of Megatron's non-distributed optimizers."""
    if not isinstance(optimizer, dict):
        raise ValueError(f"the optimizer state is a {type(optimizer).__name__}, not one of Megatron's")
    if "param_state_sharding_type" in optimizer or "per_bucket_numel" in optimizer:
        raise ValueError("it is the distributed optimizer's torch_dist form (param_state_sharding_type), whose "
                         "moments are not in a distrib_optim.pt")
    if "state" in optimizer and "param_groups" in optimizer:
        return optimizer, None, None
    inner = optimizer.get("optimizer")
    if isinstance(inner, dict) and "param_groups" in inner:
        if "param_state_sharding_type" in inner or "state" not in inner:
            raise ValueError("it is the distributed optimizer's settings without its moments (distrib_optim.pt)")
        masters = optimizer.get("fp32_from_fp16_params")
        scaler = optimizer.get("grad_scaler")
        return inner, masters if isinstance(masters, list) else None, scaler if isinstance(scaler, dict) else None
    raise ValueError(f"its keys {sorted(map(str, optimizer))[:5]} are none of Megatron's optimizers")


def _assign(groups: list[list[int]], order: list[list[str]], state: dict[Any, Any],
            shapes: dict[str, torch.Size]) -> dict[int, str] | None:
    """position -> name when the groups hold these names and every moment has its parameter's shape."""
    if [len(g) for g in groups] != [len(o) for o in order]:
        return None
    out: dict[int, str] = {}
    for ids, names in zip(groups, order):
        for pid, name in zip(ids, names):
            moments = state.get(pid)
            if isinstance(moments, dict):
                avg = moments.get("exp_avg")
                if not isinstance(avg, torch.Tensor) or avg.shape != shapes[name]:
                    return None
            out[pid] = name
    return out


def by_name(optimizer: Any, *, names: list[str], shapes: dict[str, torch.Size]) -> ForeignOptimizer:
    """The optimizer state of one rank by our parameter names.

    `names`: the rank's parameters in the source's order (every virtual chunk's, in chunk order); `shapes`: their
    shapes. ValueError with the reason when the state does not fit them.
    """
    inner, masters, scaler = _parts(optimizer)
    state = inner["state"]
    groups = [list(g["params"]) for g in inner["param_groups"]]
    matrices = [n for n in names if len(shapes[n]) >= 2]
    vectors = [n for n in names if len(shapes[n]) < 2]
    position = _assign(groups, [matrices, vectors], state, shapes)
    order = [matrices, vectors]
    if position is None:
        position, order = _assign(groups, [vectors, matrices], state, shapes), [vectors, matrices]
    if position is None:
        raise ValueError(f"its groups of {[len(g) for g in groups]} parameters do not match the model's "
                         f"{len(matrices)} matrices and {len(vectors)} LayerNorm and bias tensors")
    moments: dict[str, Moments] = {}
    for group, ids in zip(inner["param_groups"], groups):
        for pid in ids:
            entry = state.get(pid)
            if not isinstance(entry, dict) or "exp_avg" not in entry or "exp_avg_sq" not in entry:
                if entry:
                    raise ValueError(f"parameter {position[pid]} has state {sorted(entry)}, not Adam's moments")
                continue  # never stepped
            step = entry.get("step", group.get("step"))
            moments[position[pid]] = {"step": step, "exp_avg": entry["exp_avg"], "exp_avg_sq": entry["exp_avg_sq"]}
    fp32: dict[str, torch.Tensor] = {}
    if masters is not None:
        flat = [t for g in masters if isinstance(g, list) for t in g]
        named = [n for o in order for n in o]
        # Masters exist for the 16-bit parameters only; when they are not one per parameter, the weights are kept.
        if len(flat) == len(named) and all(isinstance(t, torch.Tensor) and t.shape == shapes[n]
                                           for t, n in zip(flat, named)):
            fp32 = dict(zip(named, flat))
    decay = inner["param_groups"][0 if order[0] is matrices else -1]
    hyper = {k: decay[k] for k in ("lr", "betas", "eps", "weight_decay") if k in decay}
    return ForeignOptimizer(moments=moments, masters=fp32, hyper=hyper, grad_scaler=scaler)
