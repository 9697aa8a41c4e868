"""benchmarks/generate_cpu.py: its arguments and the table its figures are read from (no timing here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "generate_cpu.py"


def _bench():
    spec = importlib.util.spec_from_file_location("generate_cpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_defaults_are_the_issues_figure():
    args = _bench().parse_args([])
    assert (args.batches, args.new_tokens) == ([1, 8], 128)


def test_the_llama_family_defaults_to_the_training_benchmarks_shape():
    args = _bench().parse_args(["--family", "llama"])
    assert (args.layers, args.hidden, args.heads, args.groups, args.ffn, args.vocab) == (6, 512, 8, 2, 1408, 8192)
    assert _bench().parse_args(["--family", "llama", "--hidden", "256"]).hidden == 256  # a flag still wins


def test_arguments_that_cannot_run_are_refused():
    bench = _bench()
    with pytest.raises(SystemExit):
        bench.parse_args(["--context", "100", "--prompt-len", "32", "--new-tokens", "128"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--hidden", "100", "--heads", "12"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--family", "llama", "--heads", "8", "--groups", "3"])


def test_ratios_and_table():
    bench = _bench()
    rows = [bench.Row(batch=1, ours=[30.0, 36.0, 33.0], theirs=[20.0, 25.0, 22.0]),
            bench.Row(batch=8, ours=[100.0, 90.0, 95.0], theirs=[100.0, 110.0, 105.0])]
    assert bench.ratios(rows[0]) == pytest.approx((33.0 / 22.0, 36.0 / 25.0))
    assert bench.ratios(rows[1]) == pytest.approx((95.0 / 105.0, 100.0 / 110.0))
    lines = bench.table(rows).splitlines()
    assert len(lines) == 3
    assert lines[1].split()[0] == "1" and lines[1].endswith("met") and "1.50x" in lines[1]
    assert lines[2].split()[0] == "8" and lines[2].endswith("missed") and "0.90x" in lines[2]
