"""benchmarks/dist_optim_cpu.py: what it counts as optimizer state, how it reads the goals, and how it orders modes.

No timing here (that is the benchmark's job); these are the pure parts its figures are read against.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "dist_optim_cpu.py"


def _bench():
    spec = importlib.util.spec_from_file_location("dist_optim_cpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_state_bytes_counts_adams_two_moments_and_the_step_counters_apart():
    bench = _bench()
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5))  # 4 tensors, 40 + 5 + 5 + 5 elements
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    assert bench.state_bytes(optimizer.state) == bench.StateBytes(moments=0, steps=0)  # no state before a step
    model(torch.randn(3, 7)).sum().backward()
    optimizer.step()
    elements = 7 * 5 + 5 + 5 + 5
    got = bench.state_bytes(optimizer.state)
    assert got.moments == 2 * 4 * elements  # exp_avg and exp_avg_sq, fp32
    assert got.steps == 4 * 4  # one fp32 scalar per parameter tensor


def _result(*, plain: int, dist: list[int], plain_times: list[float], dist_times: list[float]) -> list[dict]:
    ranks = [{"params": 1000, "bytes": {"plain": {"moments": plain, "steps": 16}, "dist": {"moments": d, "steps": 4}}}
             for d in dist]
    ranks[0]["times"] = {"plain": plain_times, "dist": dist_times}
    return ranks


def test_a_row_takes_the_fullest_rank_and_rank_0s_median_and_best_step():
    bench = _bench()
    row = bench.row_from(2, _result(plain=8000, dist=[4000, 3900], plain_times=[1.0, 3.0, 2.0],
                                    dist_times=[2.2, 2.4, 9.0]))
    assert (row.plain_bytes, row.dist_bytes) == (8000, 4000)
    assert (row.plain_s, row.dist_s, row.plain_best_s, row.dist_best_s) == (2.0, 2.4, 1.0, 2.2)
    assert row.bytes_ratio == pytest.approx(0.5)
    assert row.time_ratio == pytest.approx(1.2)
    assert row.paired == pytest.approx(2.2)  # median of 2.2/1.0, 2.4/3.0, 9.0/2.0: paired by iteration


@pytest.mark.parametrize(("dp", "dist_bytes", "met"), [(2, 5200, True), (2, 5300, False), (4, 2600, True),
                                                       (4, 2700, False)])
def test_the_bytes_goal_is_one_over_dp_plus_five_percent(dp, dist_bytes, met):
    bench = _bench()
    row = bench.row_from(dp, _result(plain=10000, dist=[dist_bytes] * dp, plain_times=[1.0], dist_times=[1.0]))
    assert row.bytes_ok is met


@pytest.mark.parametrize(("dist_s", "met"), [(1.05, True), (1.2, False)])
def test_the_time_goal_is_one_point_one_times_the_plain_step(dist_s, met):
    bench = _bench()
    row = bench.row_from(2, _result(plain=100, dist=[50, 50], plain_times=[1.0], dist_times=[dist_s]))
    assert row.time_ok is met
    line = bench.table([row]).splitlines()[-1]
    assert f"| {dist_s:.3f} ({dist_s:.3f}) | {dist_s:.3f} |" in line
    assert line.endswith("| met |" if met else "| missed |")


def test_modes_swap_every_step_so_each_leads_half_the_time():
    bench = _bench()
    orders = [bench.mode_order(i) for i in range(6)]
    assert all(sorted(o) == sorted(bench.MODES) for o in orders)
    assert [o[0] for o in orders] == ["plain", "dist"] * 3


def test_dp_below_two_is_refused():
    bench = _bench()
    assert bench.parse_args(["--dp", "2", "4"]).dp == [2, 4]
    with pytest.raises(SystemExit):
        bench.parse_args(["--dp", "1", "2"])


def test_the_overlap_row_takes_block_medians_and_pairs_blocks_of_the_same_round():
    bench = _bench()
    row = bench.overlap_row(2, {"times": {"dist": [1.0, 2.0, 4.0], "dist_overlap": [0.9, 2.2, 3.0]},
                                "loss_diff": 0.0, "compared_steps": 9})
    assert (row["dist_s"], row["overlap_s"]) == (2.0, 2.2)
    assert row["paired"] == pytest.approx(0.9)  # median of 0.9, 1.1, 0.75
    line = bench.overlap_table([row]).splitlines()[-1]
    assert line == "| 2 | 2000 ms | 2200 ms | 1.100 | 0.900 | 0.0e+00 (9) |"
