"""benchmarks/ckpt_io.py --mode split: the table its figures are read from.

No timing here (that is the benchmark's job); only the arithmetic of the table.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "ckpt_io.py"


def _bench():
    spec = importlib.util.spec_from_file_location("ckpt_io", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_split_table_gives_median_rate_and_seconds_per_gib_per_part():
    bench = _bench()
    lines = bench.split_table({"checksum, ours": [0.5, 0.25, 2.0], "load": [4.0]}, size=2 << 30)
    assert len(lines) == 2
    part, rest = lines[0][:40].strip(), lines[0][40:].split()
    # median 0.5 s of 2 GiB: 4 GiB/s, 0.25 s/GiB; the runs in the order they ran
    assert part == "checksum, ours"
    assert rest[:6] == ["0.500", "s", "4.00", "GiB/s", "0.250", "s/GiB"]
    assert lines[0].endswith("(0.500, 0.250, 2.000)")
    assert lines[1][40:].split()[:6] == ["4.000", "s", "0.50", "GiB/s", "2.000", "s/GiB"]

