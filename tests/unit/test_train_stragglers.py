"""Stragglers (issue 28 part 3): node times from the ranks' interval sums, the ratio to the median node, the window
of consecutive logs, the test-only knobs, and the pulse's step timing and hang-timeout check. A slow rank named by
a real run is tests/multiprocess/test_hangs_and_stragglers.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from megatron_hpc.errors import ConfigError
from megatron_hpc.heartbeat import read_beat
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.device import DeviceInfo
from megatron_hpc.train.pulse import Pulse, SlowdownForTests
from megatron_hpc.train.stragglers import (
    GATHER_COST_BOUND,
    KnobsForTests,
    NodeTime,
    RankNodes,
    Stragglers,
    StragglerWindow,
    gather_every,
    knobs_for_tests,
    node_times,
    ratios,
)


def test_a_nodes_compute_is_its_slowest_ranks_and_its_wait_the_mean_per_step() -> None:
    nodes = RankNodes.of(rank=0, world_size=4, workers_per_node=2, knobs=KnobsForTests())
    assert nodes.node_of == (0, 0, 1, 1)
    sums = [(2.0, 1.0), (4.0, 3.0), (2.0, 0.5), (2.0, 0.5)]
    assert node_times(sums, node_of=nodes.node_of, steps=2) == [
        NodeTime(node=0, ranks=(0, 1), compute_s=2.0, wait_s=1.0),
        NodeTime(node=1, ranks=(2, 3), compute_s=1.0, wait_s=0.25)]
    per_rank = RankNodes.of(rank=0, world_size=4, workers_per_node=2, knobs=KnobsForTests(node_per_rank=True))
    assert per_rank.node_of == (0, 1, 2, 3) and per_rank.per_rank


def test_ratios_are_against_the_median_node() -> None:
    nodes = [NodeTime(node=i, ranks=(i,), compute_s=c, wait_s=0.0) for i, c in enumerate([1.0, 1.1, 0.9, 2.0, 1.0])]
    median, by_node = ratios(nodes)
    assert median == 1.0 and by_node == {0: 1.0, 1: 1.1, 2: 0.9, 3: 2.0, 4: 1.0}


def test_a_node_is_named_after_window_logs_in_a_row_and_cleared_by_one_below() -> None:
    window = StragglerWindow(threshold=1.2, window=3)
    assert window.update({0: 1.0, 1: 1.5}) == []
    assert window.update({0: 1.0, 1: 1.3}) == []
    assert window.update({0: 1.0, 1: 1.21}) == [1]
    assert window.update({0: 1.3, 1: 1.25}) == [1]
    assert window.update({0: 1.3, 1: 1.2}) == []  # not above the threshold: the streak starts again
    assert window.update({0: 1.3, 1: 1.5}) == [0]
    interrupted = StragglerWindow(threshold=1.2, window=3)
    for ratio in (1.5, 1.5, 1.0, 1.5, 1.5):
        named = interrupted.update({0: 1.0, 1: ratio})
    assert named == []


def test_the_test_only_knobs_are_read_in_one_place_and_refuse_a_bad_value() -> None:
    assert knobs_for_tests({}) == KnobsForTests()
    got = knobs_for_tests({"MEGATRON_HPC_TEST_ONLY_SLOW_RANK": "1:0.25", "MEGATRON_HPC_TEST_ONLY_NODE_PER_RANK": "1"})
    assert got == KnobsForTests(slowdown=SlowdownForTests(rank=1, seconds=0.25), node_per_rank=True)
    with pytest.raises(ValueError, match="is not RANK:SECONDS"):
        knobs_for_tests({"MEGATRON_HPC_TEST_ONLY_SLOW_RANK": "fast"})


def _steps(pulse: Pulse, first: int, last: int) -> None:
    for iteration in range(first, last + 1):
        pulse.step_begins(iteration)
        pulse.compute_done()
        pulse.step_ends()


def test_the_pulse_times_steps_past_the_warm_up_and_beats_each_phase(tmp_path: Path) -> None:
    from megatron_hpc.heartbeat import HeartbeatWriter

    pulse = Pulse(HeartbeatWriter(tmp_path, 1, host="h"), rank=1, device=torch.device("cpu"), hang_timeout_s=None,
                  slowdown=SlowdownForTests(rank=1, seconds=0.01))
    try:
        assert read_beat(tmp_path, 1).phase == "init"
        pulse.starts_at(10)  # resumed at step 10: steps 11 and 12 are the warm-up
        _steps(pulse, 11, 12)
        assert pulse.interval() == (0.0, 0.0, 0) and read_beat(tmp_path, 1).step_s == 0.0
        pulse.step_begins(13)
        assert read_beat(tmp_path, 1).phase == "forward-backward"
        pulse.compute_done()  # the test slowdown sleeps here, in the compute section
        assert (read_beat(tmp_path, 1).phase, read_beat(tmp_path, 1).iteration) == ("optimizer", 13)
        time.sleep(0.005)
        pulse.step_ends()
        compute, wait, steps = pulse.interval()
        assert steps == 1 and compute >= 0.01 and wait >= 0.005
        assert pulse.interval() == (0.0, 0.0, 0)
        assert read_beat(tmp_path, 1).step_s == 0.0  # written at the next beat
        pulse.beat("log", 13)
        assert read_beat(tmp_path, 1).step_s >= 0.015
    finally:
        pulse.close()
    assert read_beat(tmp_path, 1).phase == "done"


def test_a_hang_timeout_shorter_than_the_first_timed_step_stops_the_run() -> None:
    pulse = Pulse(None, rank=0, device=torch.device("cpu"), hang_timeout_s=0.001,
                  slowdown=SlowdownForTests(rank=0, seconds=0.01))
    _steps(pulse, 1, 2)  # warm-up: untimed, so a compiling first step is never refused
    with pytest.raises(ConfigError, match=r"launch.hang_timeout_s=0.001 is shorter than a measured step"):
        _steps(pulse, 3, 3)


def test_the_gather_waits_until_the_steps_took_the_bound_times_its_cost(ctx: ParallelContext) -> None:
    assert GATHER_COST_BOUND == 200.0
    assert gather_every(cost_s=0.0005, step_s=0.046) == 3  # the benchmark's tiny step: 138 ms between gathers
    assert gather_every(cost_s=0.0005, step_s=1.0) == 1 and gather_every(cost_s=0.0, step_s=0.046) == 1
    pulse = Pulse(None, rank=0, device=torch.device("cpu"), hang_timeout_s=None)
    device = DeviceInfo(kind="cpu", device=torch.device("cpu"), backend="gloo")
    stragglers = Stragglers(pulse, RankNodes(rank=0, node_of=(0,)), device=device, threshold=1.2, run_dir=None,
                            enabled=True)
    _steps(pulse, 1, 3)  # 1-2 are the warm-up
    stragglers.at_log(3)  # the first two gathers are due at once: no cost is known yet
    _steps(pulse, 4, 4)
    stragglers.at_log(4)
    assert stragglers.every_steps == 1 and stragglers.last_gather == 4 and len(stragglers.costs_s) == 2
    stragglers.costs_s = (0.01, 0.02)  # as if a gather took 10 ms: 2 s of these sub-ms steps between two
    _steps(pulse, 5, 5)
    stragglers.at_log(5)
    assert stragglers.every_steps >= 100  # agreed through the gather's own table
    for step in range(6, 12):
        _steps(pulse, step, step)
        assert not stragglers.due(step)
        stragglers.at_log(step)  # skipped: the pulse keeps the steps for the next gather
    assert stragglers.last_gather == 5 and pulse.interval()[2] == 6
