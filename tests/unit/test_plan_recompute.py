"""Recompute settings: resolution of the keys, their checks before queueing, grouping, and the memory estimate."""

import dataclasses

import pytest

from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.platforms import get_platform
from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.errors import ConfigError, PlanError
from megatron_hpc.plan.memory import GIB, estimate_memory
from megatron_hpc.plan.planner import make_plan
from megatron_hpc.plan.recompute import (
    FULL_UNIFORM_1,
    Recompute,
    check_recompute_stages,
    recompute_groups,
    resolve_recompute,
)

# Dropout on, as Korthikanti et al. count (their masks and the attention dropout's output).
MODEL = ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=2048,
                    max_position_embeddings=2048, hidden_dropout=0.1, attention_dropout=0.1)


def _with(**keys) -> ModelConfig:
    return dataclasses.replace(MODEL, **keys)


def plan(overrides):
    cfg = load_recipe("tiny", list(overrides))
    return make_plan(cfg, num_nodes=1, platform=get_platform("cpu"))


def test_resolution():
    assert resolve_recompute(MODEL) == Recompute()
    assert resolve_recompute(_with(recompute=True)) == FULL_UNIFORM_1
    assert resolve_recompute(_with(recompute_granularity="full")) == FULL_UNIFORM_1
    assert resolve_recompute(_with(recompute=True, recompute_granularity="full", recompute_num_layers=2)) == \
        Recompute(granularity="full", method="uniform", num_layers=2)
    assert resolve_recompute(_with(recompute_granularity="full", recompute_method="block", recompute_num_layers=3)) \
        == Recompute(granularity="full", method="block", num_layers=3)
    assert resolve_recompute(_with(recompute_granularity="selective")).selective


@pytest.mark.parametrize("overrides, message", [
    (["model.recompute=true", "model.recompute_granularity=selective"], "drop model.recompute"),
    (["model.recompute_method=block"], "model.recompute_method='block' applies only to full recomputation; use "
                                       "--set model.recompute_granularity=full"),
    (["model.recompute_granularity=selective", "model.recompute_num_layers=2"], "model.recompute_num_layers=2 "
                                                                                "applies only to full"),
    (["model.recompute_granularity=full", "model.recompute_num_layers=0"], "must be at least 1"),
])
def test_contradicting_keys_refused_by_the_planner(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan(overrides)


def test_unknown_values_refused_at_load():
    with pytest.raises(ConfigError, match="'partial' is not allowed"):
        load_recipe("tiny", ["model.recompute_granularity=partial"])
    with pytest.raises(ConfigError, match="did you mean 'block'"):
        load_recipe("tiny", ["model.recompute_granularity=full", "model.recompute_method=blocks"])


def test_uniform_must_divide_the_stage():
    # tiny has 4 layers: groups of 3 do not tile them.
    with pytest.raises(PlanError, match=r"recompute_num_layers=3 must divide the layers of every pipeline stage "
                                        r"\(4\).*N in \{1, 2, 4\}"):
        plan(["model.recompute_granularity=full", "model.recompute_num_layers=3"])
    p = plan(["model.recompute_granularity=full", "model.recompute_num_layers=2"])
    assert p.tensor_parallel == 1


def test_stage_fit_is_per_pipeline_stage():
    check_recompute_stages(_with(recompute_granularity="full", recompute_num_layers=4), [4, 4])
    with pytest.raises(PlanError, match=r"\(2, 4\).*N in \{1, 2\}"):
        check_recompute_stages(_with(recompute_granularity="full", recompute_num_layers=4), [2, 4, 4, 2])
    check_recompute_stages(_with(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
                           [2, 2])
    with pytest.raises(PlanError, match=r"more than the 2 layers of a pipeline stage for recompute_method=block; "
                                        r"use --set model.recompute_num_layers=N with N <= 2"):
        check_recompute_stages(_with(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
                               [2, 3, 3])


def test_block_beyond_the_stage_refused_by_the_planner():
    with pytest.raises(PlanError, match="N <= 4"):
        plan(["model.recompute_granularity=full", "model.recompute_method=block", "model.recompute_num_layers=5"])


def test_groups():
    layers = range(4, 10)
    assert recompute_groups(layers, Recompute()) == [(layers, False)]
    assert recompute_groups(layers, Recompute(granularity="selective")) == [(layers, False)]
    uniform = recompute_groups(layers, Recompute(granularity="full", method="uniform", num_layers=2))
    assert [(list(g), c) for g, c in uniform] == [([4, 5], True), ([6, 7], True), ([8, 9], True)]
    block = recompute_groups(layers, Recompute(granularity="full", method="block", num_layers=2))
    assert [(list(g), c) for g, c in block] == [([4], True), ([5], True), ([6, 7, 8, 9], False)]
    whole = recompute_groups(layers, Recompute(granularity="full", method="block", num_layers=6))
    assert [(list(g), c) for g, c in whole] == [([i], True) for i in layers]


def _activations(model: ModelConfig, *, tp: int = 1, precision: str = "bf16") -> float:
    """The layers' activations on a CUDA platform: the estimate less what one micro-batch keeps outside the layers
    (the embedding's 1-byte dropout mask, the final norm's and output layer's inputs: s*b*h each)."""
    est = estimate_memory(model, padded_vocab=50304, tensor_parallel=tp, micro_batch=1, precision=precision,
                          backend="nccl")
    value = 4 if precision == "fp32" else 2
    return est.activations_gib * GIB - model.seq_length * model.hidden_size * (1 + 2 * value)


@pytest.mark.parametrize("tp", [1, 2])
def test_selective_drops_exactly_the_attention_core_term(tp):
    s, b, h, a, layers = 2048, 1, 1024, 16, 8
    plain = _activations(MODEL, tp=tp)
    selective = _activations(_with(recompute_granularity="selective"), tp=tp)
    assert plain == pytest.approx(layers * s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)))
    assert selective == pytest.approx(layers * s * b * h * (10 + 24 / tp))  # Korthikanti et al., table 2
    # fp32 doubles every activation but the 1-byte masks.
    assert _activations(_with(recompute_granularity="selective"), tp=tp, precision="fp32") == \
        pytest.approx(layers * s * b * h * (2 * 8 + 2 + 2 * 24 / tp))


def test_full_recompute_estimates():
    s, b, h, a, layers = 2048, 1, 1024, 16, 8
    layer = s * b * h * (10 + 24 + 5 * a * s / h)
    unit_input = 2 * s * b * h
    # The old boolean and its spelled-out form give the same number: every layer's input plus one layer.
    assert _activations(_with(recompute=True)) == pytest.approx(layers * unit_input + layer)
    assert _activations(_with(recompute_granularity="full")) == pytest.approx(layers * unit_input + layer)
    # Uniform groups of 4: two group inputs kept, one group of four layers alive while it is recomputed.
    assert _activations(_with(recompute_granularity="full", recompute_num_layers=4)) == \
        pytest.approx(2 * unit_input + 4 * layer)
    # Block 3: three layer inputs, the other five layers keep everything, one layer recomputed at a time.
    assert _activations(_with(recompute_granularity="full", recompute_method="block", recompute_num_layers=3)) == \
        pytest.approx(3 * unit_input + 5 * layer + layer)


def test_leaner_settings_plan_less_memory():
    def total(*overrides):
        return plan(list(overrides)).memory_per_worker_gib

    # On the CPU without attention dropout the attention kernel keeps no scores: nothing for selective to drop.
    assert total() == total("model.recompute_granularity=selective")
    dropout = ("model.attention_dropout=0.1", "model.hidden_dropout=0.1")
    plain = total(*dropout)
    selective = total(*dropout, "model.recompute_granularity=selective")
    block = total(*dropout, "model.recompute_granularity=full", "model.recompute_method=block",
                  "model.recompute_num_layers=2")
    full = total(*dropout, "model.recompute=true")
    assert plain > selective and plain > block > full
