"""The heartbeat line and the watchdog's decisions (issue 28 part 2): the hang timeout, when a step is hung, and
who is a suspect. The real watchdog on a stopped rank is tests/multiprocess/test_hangs_and_stragglers.py."""

from __future__ import annotations

import math
import os
import socket
import subprocess
from pathlib import Path

import pytest
from megatron_hpc.launch.watchdog import (
    RankView,
    Watch,
    hang_report,
    hang_timeout,
    is_hung,
    proc_state,
    suspects,
)

from megatron_hpc.heartbeat import (
    HANG_FLOOR_S,
    HANG_STEP_MULTIPLE,
    Beat,
    HeartbeatWriter,
    format_beat,
    hang_timeout_problem,
    parse_beat,
    read_beat,
)


def beat(iteration: int, phase: str = "forward-backward", *, step_s: float = 0.5, host: str = "n1") -> Beat:
    return Beat(iteration=iteration, phase=phase, wall=1000.0, step_s=step_s, pid=42, host=host)


def view(rank: int, b: Beat | None, *, age: float = 100.0, state: str | None = None) -> RankView:
    return RankView(rank=rank, beat=b, age_s=age, state=state)


def test_the_beat_is_rewritten_in_place_at_one_length_and_reads_back(tmp_path: Path) -> None:
    writer = HeartbeatWriter(tmp_path, 3, host="node-a")
    try:
        writer.beat("forward-backward", 7, step_s=0.25)
        first = (tmp_path / "heartbeat" / "rank-3").read_bytes()
        writer.beat("save", 123456, step_s=12.5)
        second = (tmp_path / "heartbeat" / "rank-3").read_bytes()
    finally:
        writer.close()
    assert len(first) == len(second) and second.count(b"\n") == 1
    got = read_beat(tmp_path, 3)
    assert got is not None and (got.iteration, got.phase, got.step_s, got.host, got.pid) == \
        (123456, "save", 12.5, "node-a", os.getpid())
    assert read_beat(tmp_path, 4) is None  # no file: not started
    # The writer's fast path writes format_beat's line exactly.
    assert second == format_beat(iteration=123456, phase="save", wall=got.wall, step_s=12.5, pid=os.getpid(),
                                 host="node-a")
    assert parse_beat(b"") is None and parse_beat(first[:20]) is None
    assert parse_beat(format_beat(iteration=1, phase="log", wall=1.5, step_s=0.0, pid=9, host="h")) == \
        Beat(iteration=1, phase="log", wall=1.5, step_s=0.0, pid=9, host="h")


def test_a_beat_whose_writer_is_gone_is_an_earlier_steps_whatever_its_clock(tmp_path: Path) -> None:
    # After an in-job restart a rank's file holds the last beat of the step before: from another machine whose
    # clock ran ahead, or from this one a second or two before this watchdog started (within CLOCK_SKEW_S). Its
    # writer is no process here: no beat of this attempt. A live writer counts whatever host name it gave.
    gone = subprocess.Popen(["true"])
    gone.wait()
    started, here = 5000.0, socket.gethostname()
    (tmp_path / "heartbeat").mkdir()
    for rank, (host, wall, pid) in enumerate([("old-node", started + 30.0, gone.pid),
                                              (here, started - 1.0, gone.pid),
                                              (here, started - 60.0, os.getpid()),
                                              ("pod-alias", started + 1.0, os.getpid()),
                                              (here, started - 1.0, os.getpid())]):
        (tmp_path / "heartbeat" / f"rank-{rank}").write_bytes(
            format_beat(iteration=9, phase="forward-backward", wall=wall, step_s=0.5, pid=pid, host=host))
    views = Watch(tmp_path, [0, 1, 2, 3, 4], started_wall=started).poll()
    assert [v.beat is not None for v in views] == [False, False, False, True, True]


def test_positions_order_the_phases_of_one_iteration_before_the_next() -> None:
    assert beat(5, "forward-backward").position < beat(5, "optimizer").position < beat(5, "save").position
    assert beat(5, "save").position < beat(6, "forward-backward").position


def test_the_timeout_waits_for_measured_steps_and_for_long_phases() -> None:
    # Before a step past the warm-up was timed (compilation), and in a save: the collective timeout.
    assert hang_timeout([beat(1, step_s=0.0)], configured=5.0, collective_timeout_s=1800) == 1800
    assert hang_timeout([beat(9), beat(9, "save")], configured=5.0, collective_timeout_s=1800) == 1800
    assert hang_timeout([], configured=5.0, collective_timeout_s=600) == 600
    # Configured, it holds once steps are timed; unset, floor or 10x the median step.
    assert hang_timeout([beat(9), beat(9)], configured=5.0, collective_timeout_s=1800) == 5.0
    assert hang_timeout([beat(9, step_s=10.0), beat(9, step_s=12.0), beat(9, step_s=300.0)], configured=None,
                        collective_timeout_s=1800) == HANG_STEP_MULTIPLE * 12.0 == 120.0
    assert hang_timeout([beat(9, step_s=0.1)], configured=None, collective_timeout_s=1800) == HANG_FLOOR_S


def test_a_hang_timeout_shorter_than_a_measured_step_is_refused_with_the_fix() -> None:
    line = hang_timeout_problem(configured=5.0, measured_step_s=12.0, iteration=3)
    assert line is not None and "launch.hang_timeout_s=5 is shorter than a measured step (12.00 s at iteration 3)" \
        in line and "--set launch.hang_timeout_s=60" in line and "\n" not in line
    assert hang_timeout_problem(configured=5.0, measured_step_s=4.0, iteration=3) is None
    assert hang_timeout_problem(configured=None, measured_step_s=400.0, iteration=3) is None


def test_hung_only_when_no_rank_moved_for_the_timeout() -> None:
    assert is_hung([view(0, beat(5), age=10), view(1, beat(5), age=11)], timeout_s=10)
    assert not is_hung([view(0, beat(5), age=10), view(1, beat(5), age=2)], timeout_s=10)
    # Nothing of this attempt yet: a failed start is torchrun's to report.
    assert not is_hung([view(0, None, age=500), view(1, None, age=500)], timeout_s=10)


def test_a_stopped_process_is_the_suspect_wherever_it_is() -> None:
    views = [view(0, beat(7, "optimizer"), state="S (sleeping)"), view(1, beat(7), state="T (stopped)"),
             view(2, beat(7, "optimizer"), state="R (running)")]
    assert suspects(views) == [1]


def test_the_ranks_not_where_the_others_were_are_named() -> None:
    # The minority position.
    assert suspects([view(0, beat(7, "optimizer")), view(1, beat(7)), view(2, beat(7, "optimizer"))]) == [1]
    assert suspects([view(0, beat(8)), view(1, beat(7, "optimizer")), view(2, beat(8)), view(3, beat(8))]) == [1]
    # No majority: the ranks furthest behind.
    assert suspects([view(0, beat(7, "optimizer")), view(1, beat(7))]) == [1]
    # No beat of this attempt: behind everyone.
    assert suspects([view(0, beat(7)), view(1, None), view(2, beat(7))]) == [1]
    # All at one place: nobody.
    assert suspects([view(0, beat(7)), view(1, beat(7))]) == []


def test_the_report_names_the_suspects_and_their_nodes() -> None:
    views = [view(0, beat(7, "optimizer", host="a"), age=31.0, state="S (sleeping)"),
             view(1, beat(7, host="b"), age=31.0), view(2, None, age=math.nan)]
    report = hang_report(views, job_id="77", timeout_s=30.0, detected_at=5.0, stacks=["/r/debug/x.txt"])
    assert report["suspect_ranks"] == [1, 2] and report["suspect_nodes"] == ["b"]
    assert report["ranks"]["0"] == {"iteration": 7, "phase": "optimizer", "age_s": 31.0, "host": "a",
                                    "state": "S (sleeping)"}
    assert report["ranks"]["2"]["iteration"] is None and report["ranks"]["2"]["age_s"] is None  # strict JSON
    assert (report["job_id"], report["timeout_s"], report["detected_at"], report["stacks"]) == \
        ("77", 30.0, 5.0, ["/r/debug/x.txt"])


def test_proc_state_reads_the_status_line(tmp_path: Path) -> None:
    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "status").write_text("Name:\tpython\nUmask:\t0022\nState:\tT (stopped)\nPid:\t12\n")
    assert proc_state(12, tmp_path) == "T (stopped)"
    assert proc_state(13, tmp_path) is None
    assert proc_state(os.getpid()).startswith("R")


@pytest.mark.parametrize("state", ["T (stopped)", "t (tracing stop)", "Z (zombie)"])
def test_every_state_that_cannot_run_counts_as_stopped(state: str) -> None:
    assert suspects([view(0, beat(3)), view(1, beat(3), state=state)]) == [1]
