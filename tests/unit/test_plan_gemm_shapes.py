"""The matrix products of one TP rank (plan/gemm_shapes.py): what tune's GEMM micro-benchmark times."""

from __future__ import annotations

import pytest

from megatron_hpc.config.loader import load_recipe
from megatron_hpc.plan.gemm_shapes import GemmShape, backward_of, benchmark_shapes, rank_gemms
from megatron_hpc.plan.model_math import flops_per_token


def test_tiny_at_tp2_by_hand():
    # tiny: h 256, 4 heads of 64, FFN 1024, s 128; micro-batch 4 gives T = 512 tokens; vocabulary 8192.
    g = rank_gemms(load_recipe("tiny", []).model, micro_batch=4, tensor_parallel=2, padded_vocab=8192)
    assert g.linears == (GemmShape(1, 512, 256, 384), GemmShape(1, 512, 128, 256), GemmShape(1, 512, 256, 512),
                         GemmShape(1, 512, 512, 256))
    assert g.core == (GemmShape(8, 128, 64, 128), GemmShape(8, 128, 128, 64))  # 4 x 4 heads / 2 batched
    assert g.output == GemmShape(1, 512, 256, 4096)
    assert GemmShape(8, 128, 64, 128).flops == 2 * 8 * 128 * 64 * 128
    # Input gradient (T, n) x (n, k) and weight gradient (k, T) x (T, n).
    assert backward_of(GemmShape(1, 512, 256, 384)) == (GemmShape(1, 512, 384, 256), GemmShape(1, 256, 512, 384))


@pytest.mark.parametrize("recipe,tp", [("tiny", 1), ("tiny", 2), ("llama3_8b", 4)])
def test_the_products_are_the_flops_the_plan_counts(recipe, tp):
    """Forward and backward (3x) of every layer's products and the output layer, over the TP group, per token: the
    plan's flops_per_token (Megatron's formula, written independently)."""
    model = load_recipe(recipe, []).model
    vocab = 128256 if recipe.startswith("llama") else 8192
    g = rank_gemms(model, micro_batch=2, tensor_parallel=tp, padded_vocab=vocab)
    forward = model.num_layers * sum(s.flops for s in (*g.linears, *g.core)) + g.output.flops
    assert 3 * forward * tp / (2 * model.seq_length) == pytest.approx(flops_per_token(model, padded_vocab=vocab))


def test_the_benchmark_times_each_distinct_product_once():
    model = load_recipe("tiny", []).model
    a = rank_gemms(model, micro_batch=4, tensor_parallel=1, padded_vocab=8192)
    b = rank_gemms(model, micro_batch=4, tensor_parallel=2, padded_vocab=8192)
    shapes = benchmark_shapes([a, a, b])
    assert len(shapes) == len(set(shapes))
    wanted = {x for gemm in (*a.all(), *b.all()) for x in (gemm, *backward_of(gemm))}
    assert set(shapes) == wanted
    # The MLP's up (T, h) x (h, f) is also its down product's input gradient: timed once.
    assert shapes.count(GemmShape(1, 512, 256, 1024)) == 1 and len(shapes) < 2 * 7 * 3
