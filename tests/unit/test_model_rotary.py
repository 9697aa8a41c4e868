"""Rotary embeddings against a direct complex-number computation, and the GPT built with them."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.errors import PlanError
from megatron_hpc.model.gpt import GPT
from megatron_hpc.model.rotary import apply_rotary, rotary_dims, rotary_tables
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.plan.checks import check_model_shape

CFG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, max_position_embeddings=32,
                  vocab_size=500, position_embedding="rope", rotary_percent=0.25)


def _reference(x: torch.Tensor, rot: int, base: float = 10000.0) -> torch.Tensor:
    """Written from the definition: pair (i, i + rot/2) is one complex number, turned by pos * base^(-2i/rot)."""
    out = x.clone().double()
    half = rot // 2
    s = x.shape[-2]
    for pos in range(s):
        for i in range(half):
            theta = pos * base ** (-2.0 * i / rot)
            z = complex(1.0, 0.0) * math.cos(theta) + 1j * math.sin(theta)
            a, b = x[..., pos, i].double(), x[..., pos, i + half].double()
            out[..., pos, i] = a * z.real - b * z.imag
            out[..., pos, i + half] = a * z.imag + b * z.real
    return out


@pytest.mark.parametrize(("head_dim", "percent"), [(16, 1.0), (16, 0.25), (32, 0.5)])
def test_rotation_matches_reference(head_dim: int, percent: float) -> None:
    x = torch.randn(2, 3, 11, head_dim, generator=torch.Generator().manual_seed(0))
    rot = rotary_dims(head_dim, rotary_percent=percent)
    cos, sin = rotary_tables(rot, max_positions=32)
    got = apply_rotary(x, cos, sin)
    torch.testing.assert_close(got.double(), _reference(x, rot), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[..., rot:], x[..., rot:], rtol=0, atol=0)  # pass-through dims untouched
    if percent < 1.0:
        assert not torch.allclose(got[..., 1:, :rot], x[..., 1:, :rot])


def test_scores_depend_on_relative_position_only() -> None:
    q, k = torch.randn(2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).unbind(0)
    cos, sin = rotary_tables(16, max_positions=64)
    cos, sin = cos.double(), sin.double()

    def score(m: int, n: int) -> float:
        qm = apply_rotary(q.expand(m + 1, 16)[None, None], cos, sin)[0, 0, m]
        kn = apply_rotary(k.expand(n + 1, 16)[None, None], cos, sin)[0, 0, n]
        return float(qm @ kn)

    # The tables are fp32: each angle is off by up to ~1e-7, so the score by that times |q| |k| (a relative bound
    # on the score itself fails when the score happens to be near zero).
    scale = float(q.norm() * k.norm())
    assert score(7, 3) == pytest.approx(score(40, 36), abs=1e-6 * scale)
    assert score(7, 3) != pytest.approx(score(7, 5), rel=1e-3)


def test_rope_gpt_has_no_position_table_and_is_causal(ctx: ParallelContext) -> None:
    model = GPT(CFG, ctx=ctx, padded_vocab=512, seed=1).eval()
    assert model.wpe is None and "rope_cos" not in model.state_dict()
    learned = GPT(dataclasses.replace(CFG, position_embedding="learned"), ctx=ctx, padded_vocab=512, seed=1)
    assert learned.num_params(ctx=ctx) - model.num_params(ctx=ctx) == 32 * 64
    assert model.rope_cos.shape == (32, 4)  # head dim 16, a quarter rotated
    ids = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[0, 10] = (ids[0, 10] + 1) % 500
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[:, :10], model(changed)[:, :10])
    # One causal attention layer without positions sees its prefix as a set: permuting the earlier
    # tokens leaves the last position's logits unchanged. With RoPE it must not.
    model = GPT(dataclasses.replace(CFG, num_layers=1), ctx=ctx, padded_vocab=512, seed=1).eval()
    permuted = torch.cat([ids[:, :15].flip(1), ids[:, 15:]], dim=1)
    with torch.no_grad():
        assert not torch.allclose(model(ids)[:, -1], model(permuted)[:, -1], atol=1e-5)
        model.rope_cos.fill_(1.0)
        model.rope_sin.zero_()
        torch.testing.assert_close(model(ids)[:, -1], model(permuted)[:, -1])


def test_rope_config_checks() -> None:
    check_model_shape(CFG, tensor_parallel=2)
    with pytest.raises(PlanError, match=r"rotary_percent 0\.1"):
        check_model_shape(dataclasses.replace(CFG, rotary_percent=0.1), tensor_parallel=1)  # 1.6 dims of 16
