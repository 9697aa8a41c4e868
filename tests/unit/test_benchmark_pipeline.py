"""benchmarks/pipeline_cpu.py: the ideal it divides by is the bubble formula's, and its cases share the cores.

No timing here (that is the benchmark's job); these are the pure parts its figures are read against.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "pipeline_cpu.py"


def _bench():
    spec = importlib.util.spec_from_file_location("pipeline_cpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("m", [2, 8, 16, 64])
def test_the_1f1b_ideal_is_m_plus_p_minus_1_stage_times(m):
    bench = _bench()
    t1, p = 3.2, 2  # one-thread whole-model step over m micro-batches
    t_stage = t1 / (m * p)  # one micro-batch's forward and backward on one of p stages
    assert bench.ideal_step(t1, pipeline=p, micro_batches=m, virtual=1) == pytest.approx((m + p - 1) * t_stage)


@pytest.mark.parametrize("m", [8, 16])
def test_the_interleaved_ideal_is_shorter_and_close_to_the_papers(m):
    bench = _bench()
    t1, p, v = 3.2, 2, 2
    plain = bench.ideal_step(t1, pipeline=p, micro_batches=m, virtual=1)
    interleaved = bench.ideal_step(t1, pipeline=p, micro_batches=m, virtual=v)
    assert t1 / p < interleaved < plain
    paper = (m + (p - 1) / v) * t1 / (m * p)  # Narayanan et al. 2021, interleaved 1F1B
    assert interleaved == pytest.approx(paper, rel=0.004)


def test_every_case_uses_the_same_cores():
    bench = _bench()
    cases = bench.cases(16)
    assert [c.name for c in cases] == ["anchor", "1f1b", "interleaved", "one-thread"]
    for case in cases[:3]:
        assert case.pipeline * case.threads == bench.CORES, case
    assert {c.micro_batches for c in cases} == {16}
    assert [c.virtual for c in cases] == [1, 1, 2, 1]


def test_the_verdict_calls_mixed_rounds_not_measurable():
    bench = _bench()
    assert bench.verdict([0.97, 1.02, 0.99]).startswith("not measurable")
    assert bench.verdict([0.95, 0.97]) == "faster in every round"
    assert bench.verdict([1.05, 1.01]) == "slower in every round"


def test_the_summary_takes_the_median_of_round_medians_and_the_best_step():
    bench = _bench()
    summary = bench.summarize([[1.0, 3.0, 2.0], [9.0, 8.0, 7.0], [0.5, 5.0, 6.0]])
    assert summary.per_round == [2.0, 8.0, 5.0]
    assert (summary.median, summary.best) == (5.0, 0.5)
