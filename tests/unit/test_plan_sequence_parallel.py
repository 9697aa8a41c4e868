"""parallel.sequence_parallel in the planner: refusals with the fix, and Korthikanti et al.'s activation memory."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.platforms import get_platform
from megatron_hpc.errors import PlanError
from megatron_hpc.plan.memory import GIB, estimate_memory
from megatron_hpc.plan.planner import make_plan

DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)  # Korthikanti et al. count with dropout


def _io(m, t: int = 1) -> float:
    """16-bit, one micro-batch, both ends on one rank: the embedding's 1-byte mask, the final norm's and the output
    layer's 2-byte inputs (sequence shards with SP when t > 1)."""
    sbh = m.seq_length * m.hidden_size
    return sbh * (1 + 2 + 2) / t


def _plan(overrides: list[str], nodes: int = 1, platform: str = "trn1"):
    cfg = load_recipe("gpt3_6.7b", overrides)
    return make_plan(cfg, num_nodes=nodes, platform=get_platform(platform))


def test_sequence_parallel_without_tensor_parallel_is_refused_with_the_fix():
    with pytest.raises(PlanError, match=r"above 1 \(parallel.tensor is 1\); use --set parallel.tensor=2$"):
        _plan(["parallel.sequence_parallel=true", "parallel.tensor=1"])


def test_sequence_length_must_split_over_tensor_parallel():
    with pytest.raises(PlanError, match=r"seq_length=2047 .*parallel.tensor=8"):
        _plan(["parallel.sequence_parallel=true", "parallel.tensor=8", "model.seq_length=2047"])


def test_sequence_parallel_plans_at_tp_8():
    p = _plan(["parallel.sequence_parallel=true", "parallel.tensor=8"], nodes=16)
    assert p.tensor_parallel == 8


@pytest.mark.parametrize("t", [2, 8])
def test_activation_memory_follows_korthikanti(t):
    cfg = load_recipe("gpt3_7.5b")
    m = dataclasses.replace(cfg.model, recompute=False, **DROPOUT)
    args = dict(padded_vocab=51200, tensor_parallel=t, micro_batch=1, precision="bf16", backend="xla")
    plain = estimate_memory(m, **args)
    sp = estimate_memory(m, **args, sequence_parallel=True)
    s, h, a, n = m.seq_length, m.hidden_size, m.num_attention_heads, m.num_layers
    assert plain.activations_gib * GIB == pytest.approx(n * s * h * (10 + 24 / t + 5 * a * s / (h * t)) + _io(m))
    assert sp.activations_gib * GIB == pytest.approx(n * s * h / t * (34 + 5 * a * s / h) + _io(m, t))
    # Only the activations shrink: weights, optimizer state and logits are the same.
    assert sp.weights_and_optimizer_gib == plain.weights_and_optimizer_gib
    assert sp.logits_gib == plain.logits_gib


def test_recompute_keeps_sequence_shards_of_the_layer_inputs():
    cfg = load_recipe("gpt3_7.5b")
    m = dataclasses.replace(cfg.model, recompute=True, **DROPOUT)
    t = 4
    args = dict(padded_vocab=51200, tensor_parallel=t, micro_batch=1, precision="bf16", backend="xla")
    sp = estimate_memory(m, **args, sequence_parallel=True)
    s, h, a, n = m.seq_length, m.hidden_size, m.num_attention_heads, m.num_layers
    assert sp.activations_gib * GIB == pytest.approx(n * 2 * s * h / t + s * h / t * (34 + 5 * a * s / h)
                                                     + _io(m, t))


def test_selective_recompute_with_sequence_parallelism_drops_only_the_attention_core():
    cfg = load_recipe("gpt3_7.5b")
    m = dataclasses.replace(cfg.model, recompute=False, recompute_granularity="selective", **DROPOUT)
    t = 8
    args = dict(padded_vocab=51200, tensor_parallel=t, micro_batch=1, precision="bf16", backend="xla")
    sp = estimate_memory(m, **args, sequence_parallel=True)
    s, h, n = m.seq_length, m.hidden_size, m.num_layers
    # Korthikanti et al. eq. 6: with both, 34 * s * b * h / t per layer.
    assert sp.activations_gib * GIB == pytest.approx(n * s * h * 34 / t + _io(m, t))


def test_uniform_groups_keep_sequence_shards_of_their_inputs():
    cfg = load_recipe("gpt3_7.5b")
    m = dataclasses.replace(cfg.model, recompute=False, recompute_granularity="full", recompute_method="uniform",
                            recompute_num_layers=4, **DROPOUT)
    t = 4
    args = dict(padded_vocab=51200, tensor_parallel=t, micro_batch=1, precision="bf16", backend="xla")
    sp = estimate_memory(m, **args, sequence_parallel=True)
    s, h, a, n = m.seq_length, m.hidden_size, m.num_attention_heads, m.num_layers
    group_recomputed = 4 * s * h / t * (34 + 5 * a * s / h)
    assert sp.activations_gib * GIB == pytest.approx(n / 4 * 2 * s * h / t + group_recomputed + _io(m, t))


def test_a_planner_chosen_tp_starts_at_2_with_sequence_parallelism():
    # gpt3_1.7b fits at TP 1 on p5; with SP and TP left to the planner it takes the smallest TP that SP allows.
    def plan(overrides):
        return make_plan(load_recipe("gpt3_1.7b", overrides), num_nodes=4, platform=get_platform("p5"))

    plain = plan(["parallel.tensor=0"])
    sp = plan(["parallel.tensor=0", "parallel.sequence_parallel=true"])
    assert plain.tensor_parallel == 1 and sp.tensor_parallel == 2


def test_an_mqa_model_after_a_recipe_with_sequence_parallelism_is_refused_for_that_reason():
    """One key/value group allows only TP 1, which sequence parallelism cannot use: the refusal says so and offers
    turning it off (the search alone found no mesh and blamed the global batch, with the wrong fix)."""
    cfg = load_recipe("llama3_8b", ["model.num_query_groups=1"])
    with pytest.raises(PlanError) as refused:
        make_plan(cfg, num_nodes=16, platform=get_platform("p5"))
    message = str(refused.value)
    assert "sequence_parallel needs TP above 1" in message and "1 key/value groups" in message, message
    assert message.endswith("use --set parallel.sequence_parallel=false") and "global batch" not in message
    fixed = make_plan(load_recipe("llama3_8b", ["model.num_query_groups=1", "parallel.sequence_parallel=false"]),
                      num_nodes=16, platform=get_platform("p5"))
    assert fixed.tensor_parallel == 1
