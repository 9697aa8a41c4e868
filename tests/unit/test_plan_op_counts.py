"""The per-operator term of the step-time model (issue 29): plan/op_counts.py's pure count of a layer's operators
against the real aten operators our layer dispatches, counted once at a tiny shape."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_hpc.config.loader import load_recipe
from megatron_hpc.model.gpt import Block
from megatron_hpc.model.rotary import rotary_dims, rotary_tables, scaling_of
from megatron_hpc.plan.op_counts import layer_ops

SMALL = ["model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=16",
         "model.max_position_embeddings=16"]
VARIANTS = {
    "gpt": [],
    "gpt, dropout": ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"],
    "llama": ["model.normalization=rmsnorm", "model.swiglu=true", "model.add_bias_linear=false",
              "model.position_embedding=rope", "model.num_query_groups=2", "model.tie_embeddings=false"],
    "neox": ["model.parallel_residual=true", "model.position_embedding=rope", "model.rotary_percent=0.25"],
}
TOLERANCE = 0.05
"""GPT's layer (every recipe of ours but the Llama/Qwen/Pythia ones) is counted exactly; the others within 5%: the
pure count is read off the code component by component, and views autograd adds or folds around a composite
(RMSNorm's parts, GQA's reshapes) move them by an operator or two."""


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_pure_count_matches_the_layers_real_operators(ctx, name):
    cfg = load_recipe("tiny", [*SMALL, *VARIANTS[name]]).model
    block = Block(cfg, ctx=ctx, seed=1, index=0).train()
    rope = None
    if cfg.position_embedding != "learned":
        rot = rotary_dims(cfg.head_dim, rotary_percent=cfg.rotary_percent)
        cos, sin = rotary_tables(rot, max_positions=cfg.seq_length, base=cfg.rotary_base, scaling=scaling_of(cfg))
        rope = (cos, sin)
    x = torch.randn(2, cfg.seq_length, cfg.hidden_size, requires_grad=True)
    grad = torch.ones(2, cfg.seq_length, cfg.hidden_size)
    with _Count() as forward:
        y = block(x, rope)
    with _Count() as backward:
        y.backward(grad)
    real_f, real_b = sum(forward.ops.values()), sum(backward.ops.values())
    pure = layer_ops(cfg)
    if name == "gpt":
        assert (pure.forward, pure.backward) == (real_f, real_b), (forward.ops, backward.ops)
    assert pure.forward == pytest.approx(real_f, rel=TOLERANCE), (pure, forward.ops)
    assert pure.backward == pytest.approx(real_b, rel=TOLERANCE), (pure, backward.ops)
