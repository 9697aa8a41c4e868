"""benchmarks/serve_latency.py: its arguments and the table its figures are read from (no timing here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_latency.py"


def _bench():
    spec = importlib.util.spec_from_file_location("serve_latency", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_defaults_are_a_tiny_greedy_request_and_bad_counts_are_refused():
    bench = _bench()
    args = bench.parse_args([])
    assert args.ckpt is None and args.tokens == 8 and args.vocab_file.is_file() and args.merge_file.is_file()
    for bad in (["--rounds", "0"], ["--tokens", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_overhead_is_the_difference_of_medians_and_the_table_says_whether_the_goal_is_met():
    bench = _bench()
    met = bench.Timings(server_ms=[12.0, 14.0, 13.0], engine_ms=[10.0, 9.0, 11.0],
                         refused_ms=[2.0, 1.5, 2.5])
    assert met.overhead_ms == pytest.approx(3.0)
    text = bench.table(met)
    assert "13.00" in text and "10.00" in text and "2.00" in text and "overhead (median - median): 3.00 ms" in text
    assert text.endswith("met") and "missed" not in text
    missed = bench.Timings(server_ms=[40.0], engine_ms=[10.0], refused_ms=[1.0])
    assert missed.overhead_ms == pytest.approx(30.0) and bench.table(missed).endswith("missed")
