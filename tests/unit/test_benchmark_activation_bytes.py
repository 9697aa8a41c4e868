"""benchmarks/activation_bytes.py's pure parts: the paper's formulas and the table."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "activation_bytes.py"
_spec = importlib.util.spec_from_file_location("activation_bytes", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_paper_formulas_in_fp32():
    s, b, h, a, layers = 512, 2, 256, 8, 8
    sbh = s * b * h
    # Korthikanti et al. eq. 1 per layer, 16-bit: sbh(10 + 24/t + 5as/(ht)); masks raised to 2 bytes (+2 sbh);
    # doubled for fp32.
    assert bench.paper_bytes("plain", layers=layers, s=s, b=b, h=h, a=a) == \
        pytest.approx(layers * (sbh * (10 + 24 + 5 * a * s / h) + 2 * sbh) * 2)
    # eq. 6: SP with selective recomputation at t = 2 is 34 sbh / t.
    assert bench.paper_bytes("sp_tp2_selective", layers=layers, s=s, b=b, h=h, a=a) == \
        pytest.approx(layers * (34 * sbh / 2 + sbh) * 2)
    # SP shards the LayerNorm and dropout part: less than TP alone at the same t.
    assert bench.paper_bytes("sp_tp2", layers=layers, s=s, b=b, h=h, a=a) < \
        bench.paper_bytes("tp2", layers=layers, s=s, b=b, h=h, a=a)


def test_table_ratios():
    rows = [{"mode": "plain", "measured": 200.0, "estimate": 100.0, "paper": 400.0},
            {"mode": "selective", "measured": 50.0, "estimate": 50.0, "paper": 25.0}]
    lines = bench.table(rows).splitlines()
    assert lines[2].split("|")[2:8] == [" 0.00 ", " 1.000 ", " 0.00 ", " 2.000 ", " 0.00 ", " 0.500 "]
    assert lines[3].split("|")[3].strip() == "0.250" and lines[3].split("|")[7].strip() == "2.000"
