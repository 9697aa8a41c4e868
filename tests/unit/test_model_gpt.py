"""The GPT at TP=1: parameter count, Megatron init, recomputation, config checks."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.errors import PlanError
from megatron_hpc.model.gpt import GPT
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_hpc.plan.checks import check_model_shape

CFG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, max_position_embeddings=32,
                  vocab_size=500, init_method_std=0.02)


def test_parameter_count_matches_formula(ctx: ParallelContext) -> None:
    h, n_layer, v, p = 64, 2, 512, 32
    per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h)
    model = GPT(CFG, ctx=ctx, padded_vocab=v, seed=1)
    assert model.num_params(ctx=ctx) == v * h + p * h + n_layer * per_layer + 2 * h


def test_megatron_init(ctx: ParallelContext) -> None:
    big = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=8, max_position_embeddings=8,
                      vocab_size=1000, init_method_std=0.02)
    model = GPT(big, ctx=ctx, padded_vocab=1024, seed=3)
    assert model.h["0"].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.h["0"].mlp.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.02)
    assert torch.count_nonzero(model.h["0"].attn.qkv.bias) == 0
    assert torch.equal(model.h["0"].ln_1.weight, torch.ones(256))
    again = GPT(big, ctx=ctx, padded_vocab=1024, seed=3)
    assert torch.equal(model.h["3"].mlp.fc.weight, again.h["3"].mlp.fc.weight)  # seeded, reproducible
    assert not torch.equal(model.h["3"].mlp.fc.weight, model.h["2"].mlp.fc.weight)  # each layer its own draw


def _loss_and_grads(model: GPT, ids: torch.Tensor, ctx: ParallelContext) -> tuple[float, list[torch.Tensor]]:
    loss = vocab_parallel_cross_entropy(model(ids[:, :-1]), ids[:, 1:], group=ctx.tp_group).mean()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def test_recompute_changes_nothing(ctx: ParallelContext) -> None:
    ids = torch.randint(0, 500, (2, 17), generator=torch.Generator().manual_seed(0))
    plain = GPT(CFG, ctx=ctx, padded_vocab=512, seed=1)
    recomputed = GPT(ModelConfig(**{**{f: getattr(CFG, f) for f in CFG.__slots__}, "recompute": True}),
                     ctx=ctx, padded_vocab=512, seed=1)
    loss_a, grads_a = _loss_and_grads(plain, ids, ctx)
    loss_b, grads_b = _loss_and_grads(recomputed, ids, ctx)
    assert loss_a == pytest.approx(loss_b, rel=1e-6) and loss_a == pytest.approx(math.log(512), rel=0.05)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b)


def test_causal(ctx: ParallelContext) -> None:
    model = GPT(CFG, ctx=ctx, padded_vocab=512, seed=1).eval()
    ids = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[0, 10] = (ids[0, 10] + 1) % 500
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[:, :10], model(changed)[:, :10])
        assert not torch.allclose(model(ids)[:, 10:], model(changed)[:, 10:])


def test_config_checks() -> None:
    with pytest.raises(PlanError, match=r"parallel\.tensor=3"):
        check_model_shape(CFG, tensor_parallel=3)
    with pytest.raises(PlanError, match="max_position_embeddings"):
        check_model_shape(ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=64,
                                       max_position_embeddings=32), tensor_parallel=1)
