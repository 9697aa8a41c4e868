"""How many operators a rank dispatches for one transformer layer and one micro-batch, forward and backward: what
the step-time model's per-operator term (plan/steptime.py `dispatch`) multiplies by a calibrated cost. Pure.

Each count is every aten operator our layer (model/gpt.py Block) sends through torch's dispatcher, as a
TorchDispatchMode sees it in eager mode: kernels (norms, products, activation, residual adds, dropout, attention)
and the metadata operators around them (views, transposes, the autograd engine's detaches of each parameter's
gradient), which cost host time each although they move no bytes. The constants below are read off our layer's
code, component by component; tests/unit/test_plan_op_counts.py counts the real operators of the layer at a tiny
shape and holds these to them.

Why a count and not bytes: on an eager backend each operator pays a fixed cost (Python and C++ dispatch, autograd
bookkeeping, an allocation, on CUDA a kernel launch) whatever its size, so a layout that runs more micro-batches
per rank (TP: the global batch fixed, DP smaller) pays it more often, with the same FLOPs and bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.plan.model_math import mlp_matrices


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerOps:
    forward: int
    backward: int

    @property
    def total(self) -> int:
        return self.forward + self.backward


# (forward, backward) operators of each component, as model/gpt.py runs them on an eager backend.
_LINEAR = (4, 10)
"""A linear: weight transpose, the product, two views of its 3-D input and output; backward: the input- and
weight-gradient products, four transposes, three views and the weight gradient's detach."""
_BIAS = (0, 2)
"""A linear's bias (the product becomes addmm, one operator either way): its gradient's sum and detach."""
_LAYERNORM = (1, 3)
"""One fused kernel each way, and the weight's and bias's gradient detaches."""
_RMSNORM = (7, 16)
"""torch's RMSNorm runs as its parts on CPU (pow, mean, add, rsqrt, two products), and their backwards."""
_QKV_SPLIT = (11, 11)
"""Splitting the fused QKV output into heads (three selects, four transposes, views) and back (with two more
views and detaches that autograd adds around the attention core)."""
_FLASH_CORE = (2, 1)
"""scaled_dot_product_attention without dropout: one fused kernel each way (and its output's detach)."""
_MATH_CORE = (31, 20)
"""scaled_dot_product_attention with dropout falls back to its math path: the causal mask, two batched products,
softmax, the dropout's mask and scaling, their views and copies."""
_DROPOUT = (4, 1)
"""A hidden dropout: empty_like, bernoulli_, the scaling and the product; backward the product."""
_ROPE = (16, 16)
"""Rotary embedding of q and k (rotate_half's split, neg and cat, two products and the add each), both ways."""
_PARTIAL_ROPE = (6, 8)
"""Rotating part of each head (rotary_percent below 1): the slices and the concatenation of the two parts."""
_RESIDUAL = (2, 4)
"""The two residual adds; backward, the residual stream's gradient sums."""


def layer_ops(model: ModelConfig) -> LayerOps:
    """Operators of one layer for one micro-batch on one rank, forward and backward (module docstring). The same at
    any TP size: TP shrinks each operator, not their number (its collectives are costed as communication)."""
    linears = 4 + (mlp_matrices(model) - 2)  # QKV, attention output, MLP up (and SwiGLU's gate), MLP down
    biased = (linears if model.add_bias_linear else 0) + (1 if model.qkv_bias and not model.add_bias_linear else 0)
    norm = _RMSNORM if model.normalization == "rmsnorm" else _LAYERNORM
    act = (2, 3) if model.swiglu else (1, 1)  # silu and the gate's product; GeLU
    core = _MATH_CORE if model.attention_dropout > 0 else _FLASH_CORE
    drops = 2 if model.hidden_dropout > 0 else 0
    rope = (0, 0) if model.position_embedding == "learned" else _ROPE
    if model.position_embedding != "learned" and model.rotary_percent < 1.0:
        rope = (rope[0] + _PARTIAL_ROPE[0], rope[1] + _PARTIAL_ROPE[1])
    parts = [(linears * _LINEAR[0], linears * _LINEAR[1]), (biased * _BIAS[0], biased * _BIAS[1]),
             (2 * norm[0], 2 * norm[1]), _QKV_SPLIT, core, act, (drops * _DROPOUT[0], drops * _DROPOUT[1]), rope,
             _RESIDUAL]
    return LayerOps(forward=sum(p[0] for p in parts), backward=sum(p[1] for p in parts))
