"""How much work `plan` does (issue 29's goal: under 0.5 s for any shipped recipe at 512 nodes, refusals
included). Counts of evaluations, not timings: the memory model's costly terms are computed once per argument set,
a rank is estimated once per distinct set of chunks, and the kept results are the ones computed afresh."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.platforms import get_platform
from megatron_hpc.errors import PlanError
from megatron_hpc.plan import memory
from megatron_hpc.plan.memory import PipelineShape, estimate_memory, estimate_ranks, rank_terms, settled_micro_batches
from megatron_hpc.plan.planner import clear_plan_caches, make_plan


@pytest.fixture
def counted_ranks(monkeypatch):
    """How many pipeline ranks the memory model estimates (the real function, counted)."""
    calls = []
    real = memory._rank_memory

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(memory, "_rank_memory", counting)
    clear_plan_caches()
    yield calls
    clear_plan_caches()


def test_refusal_that_searches_node_counts_evaluates_each_term_once(counted_ranks):
    # 16 trn1 nodes cannot hold 405B at any layout: the refusal plans each fix, then 300 plans over node counts.
    # Before the caches this estimated 8778 pipeline ranks and computed every rank's terms afresh.
    with pytest.raises(PlanError) as refusal:
        make_plan(load_recipe("llama3.1_405b"), num_nodes=16, platform=get_platform("trn1"))
    assert str(refusal.value).endswith("none fits at this size (16 x trn1), nor at any node count up to 151")
    assert "needs about 27.2 GiB per worker at parallel.tensor=8 x parallel.pipeline=16" in str(refusal.value)
    assert rank_terms.cache_info().misses <= 80  # one per distinct (chunks, TP, settings): 60 here
    assert len(counted_ranks) <= 3000  # 2544: the first, the last and one middle rank per distinct estimate


def test_a_plan_made_twice_computes_nothing_new():
    clear_plan_caches()
    cfg, trn2 = load_recipe("gpt3_175b", ["parallel.tensor=0", "parallel.pipeline=0"]), get_platform("trn2")
    first = make_plan(cfg, num_nodes=64, platform=trn2)
    evaluated = rank_terms.cache_info().misses
    assert make_plan(cfg, num_nodes=64, platform=trn2) == first
    assert rank_terms.cache_info().misses == evaluated


SHAPES = [
    PipelineShape(stage_layers=(96,)),
    PipelineShape(stage_layers=(6,) * 16, pipeline=16, num_micro_batches=4),
    PipelineShape(stage_layers=(6,) * 16, pipeline=16, num_micro_batches=64),
    PipelineShape(stage_layers=(4, *(7,) * 12, 8), pipeline=14, num_micro_batches=30),
    PipelineShape(stage_layers=(3,) * 32, pipeline=8, virtual=4, num_micro_batches=8),
    PipelineShape(stage_layers=(3,) * 32, pipeline=8, virtual=4, num_micro_batches=512),
    PipelineShape(stage_layers=(12,) * 8, pipeline=8, schedule="afab", num_micro_batches=24),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"p{s.pipeline}v{s.virtual}{s.schedule}m{s.num_micro_batches}")
@pytest.mark.parametrize("shards", [1, 48])
def test_heaviest_rank_is_the_one_every_rank_estimated_gives(shape, shards):
    """The kept, deduplicated estimate equals the max over every rank computed afresh at the true micro-batch count."""
    clear_plan_caches()
    model = load_recipe("gpt3_175b").model
    if len(shape.stage_layers) == 1:
        model = dataclasses.replace(model, num_layers=96)
    kwargs = dict(padded_vocab=51200, tensor_parallel=8, micro_batch=1, precision="bf16", backend="nccl",
                  sequence_parallel=True, optimizer_shards=shards)
    every = estimate_ranks(model, pipeline=shape, **kwargs)
    assert estimate_memory(model, pipeline=shape, **kwargs) == max(every, key=lambda e: e.total_gib)
    if shape.pipeline > 1:  # past the settled count more micro-batches change nothing; below it every one counts
        settled = settled_micro_batches(shape)
        assert settled <= shape.num_micro_batches
        more = dataclasses.replace(shape, num_micro_batches=shape.num_micro_batches + 7)
        assert (estimate_ranks(model, pipeline=more, **kwargs) == every) == (settled_micro_batches(more) == settled)
