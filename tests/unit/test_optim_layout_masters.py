"""optim_layout.with_masters: a checkpoint's fp32 weights become the master copies an optimizer with fp32 masters
beside bf16 weights (train/xla_zero.py) starts from, where the saved state has none."""

from __future__ import annotations

import torch

from megatron_hpc.checkpoint.conversion import with_masters
from megatron_hpc.checkpoint.conversion.optim_layout import param_order


def _state(step: float) -> dict[str, torch.Tensor]:
    return {"step": torch.tensor(step), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}


def test_fp32_weights_fill_missing_masters_only() -> None:
    model = {"a.weight": torch.randn(2, 2), "b.bias": torch.randn(2), "c.weight": torch.randn(2, 2).bfloat16(),
             "d.weight": torch.randn(2, 2)}
    order = param_order(model)
    assert order == ["a.weight", "c.weight", "d.weight", "b.bias"]  # matrices, then 1-D tensors
    own = torch.full((2, 2), 7.0)
    optimizer = {"param_groups": [{"lr": 1.0, "params": [0, 1, 2]}, {"lr": 1.0, "params": [3]}],
                 "state": {0: _state(3), 1: _state(3), 2: {**_state(3), "main_param": own}, 3: _state(3)}}
    out = with_masters(optimizer, model=model, key="main_param")
    assert out["state"][0]["main_param"] is model["a.weight"]
    assert out["state"][3]["main_param"] is model["b.bias"]  # positions follow the groups, not the dict order
    assert "main_param" not in out["state"][1]  # a bf16 weight is no master: it would be the rounding
    assert out["state"][2]["main_param"] is own  # a saved master wins
    assert all("main_param" not in s for i, s in optimizer["state"].items() if i != 2)  # the input is not changed


def test_a_never_stepped_parameter_gets_no_state() -> None:
    model = {"a.weight": torch.randn(2, 2), "b.bias": torch.randn(2)}
    optimizer = {"param_groups": [{"params": [0]}, {"params": [1]}], "state": {1: _state(1)}}
    out = with_masters(optimizer, model=model, key="main_param")
    assert set(out["state"]) == {1} and out["state"][1]["main_param"] is model["b.bias"]
