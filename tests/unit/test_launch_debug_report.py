"""`megatron-hpc debug`'s report: where each rank's main thread is, from real faulthandler output and
py-spy's documented format; ranks grouped by it, the odd one out listed apart."""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from pathlib import Path

import pytest
from megatron_hpc.launch.debug_run import DebugReport, format_report, group_ranks, innermost_frame, worker_step
from megatron_hpc.launch.stack_dump import RankStacks, find_workers

from megatron_hpc.cli.main import main


def _blocked_in_here(path: Path, ready: threading.Event, done: threading.Event) -> None:
    ready.set()
    done.wait()


def test_innermost_frame_of_real_faulthandler_output(tmp_path: Path) -> None:
    out = tmp_path / "stacks"
    ready, done = threading.Event(), threading.Event()
    helper = threading.Thread(target=_blocked_in_here, args=(out, ready, done))
    helper.start()
    ready.wait()
    with out.open("w") as fh:
        faulthandler.dump_traceback(fh, all_threads=True)  # what SIGUSR1 makes a rank write
    done.set()
    helper.join()
    frame = innermost_frame(out.read_text())
    # The dumping thread is the current one: its innermost frame is this test, not the helper thread.
    assert "test_innermost_frame_of_real_faulthandler_output" in frame and "test_launch_debug_report.py" in frame


def test_innermost_frame_of_py_spy_output() -> None:
    text = ('Process 4242: python -m megatron_hpc train\nPython v3.11.7\n\n'
            'Thread 4250 (idle): "Thread-1"\n    wait (threading.py:320)\n\n'
            'Thread 4242 (idle): "MainThread"\n    _wait_all (megatron_hpc/parallel/grads.py:155)\n'
            '    finish (megatron_hpc/parallel/grads.py:150)\n')
    assert innermost_frame(text) == "_wait_all (megatron_hpc/parallel/grads.py:155)"


def test_ranks_grouped_with_the_odd_one_apart() -> None:
    def stacks(frame: str) -> str:
        return f'Thread 1 (active): "MainThread"\n    {frame}\n    train (megatron_hpc/train/loop.py:140)\n'

    ranks = [RankStacks(rank=r, pid=100 + r, host="n1", method="py-spy",
                        stacks=stacks("all_reduce (torch/distributed/distributed_c10d.py:2500)")) for r in (0, 1, 3)]
    ranks.append(RankStacks(rank=2, pid=102, host="n2", method="py-spy", stacks=stacks("batch (data/loader.py:80)")))
    ranks.append(RankStacks(rank=4, pid=104, host="n2", method="signal", stacks="", error="no stacks in 20 s"))
    groups = group_ranks(ranks)
    assert groups[0] == {"frame": "all_reduce (torch/distributed/distributed_c10d.py:2500)", "ranks": [0, 1, 3]}
    assert {"frame": "batch (data/loader.py:80)", "ranks": [2]} in groups
    assert any(g["ranks"] == [4] and "no stacks" in g["frame"] for g in groups)
    text = format_report(DebugReport(run_dir="/runs/x", job_id="12", world_size=8, ranks=ranks,
                                     missing=[5, 6, 7], groups=groups))
    assert "stacks of 5/8 ranks; missing ranks 5-7" in text
    assert "ranks 0-1,3" in text and "===== rank 2 (host n2, pid 102, py-spy) =====" in text


def test_debug_of_a_run_that_is_not_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["submit", "--recipe", "tiny", "--cluster", "local", "--dry-run", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["debug", str(out)]) == 1
    assert "no trainer worker of" in capsys.readouterr().err


def _fake_process(proc: Path, pid: int, *, run_dir: Path, env: dict[str, str], argv: list[str] | None = None) -> None:
    entry = proc / str(pid)
    entry.mkdir(parents=True)
    argv = argv or [sys.executable, "-m", "megatron_hpc", "train", "--run-dir", str(run_dir), "--phase", "run"]
    (entry / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (entry / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    (entry / "cwd").symlink_to(run_dir)


def test_workers_found_by_command_line_and_torchrun_variables(tmp_path: Path) -> None:
    """A /proc-shaped tree: workers of this run, a worker of another run, the torchrun agent, and (as on the test
    cluster, where several SLURM nodes share one machine) a worker started by another node's slurmd."""
    run_dir, proc = tmp_path / "run", tmp_path / "proc"
    run_dir.mkdir()
    mine = {"RANK": "0", "GROUP_RANK": "0", "SLURMD_NODENAME": "node1"}
    _fake_process(proc, 100, run_dir=run_dir, env=mine)
    _fake_process(proc, 101, run_dir=run_dir, env={**mine, "RANK": "1"})
    _fake_process(proc, 102, run_dir=run_dir, env={"RANK": "2", "GROUP_RANK": "1", "SLURMD_NODENAME": "node2"})
    _fake_process(proc, 103, run_dir=run_dir, env={"GROUP_RANK": "0"})  # no RANK: not a worker
    other = tmp_path / "other"
    other.mkdir()
    _fake_process(proc, 104, run_dir=other, env={**mine, "RANK": "3"})
    _fake_process(proc, 105, run_dir=run_dir, env=mine,
                  argv=["/usr/bin/torchrun", "-m", "megatron_hpc", "train", "--run-dir", str(run_dir)])
    found = find_workers(run_dir, proc, node_name="node1")
    assert [(w.rank, w.pid) for w in found] == [(0, 100), (1, 101)]
    assert [(w.rank, w.pid) for w in find_workers(run_dir, proc)] == [(0, 100), (1, 101), (2, 102)]


def test_debug_dumps_the_current_worker_step_not_the_allocation() -> None:
    # A job with a spare after one in-job restart: step 0 lost node1 and may still be listed while it completes,
    # step 1 runs on node2,node3 and a debug step of an earlier `debug` call shares node2.
    steps = ("42.batch batch node1\n42.extern extern node[1-4]\n42.0 bash node[1-2]\n"
             "42.2 megatron-hpc-debug node2\n42.1 bash node[2-3]\n")
    assert worker_step(steps) == ("42.1", "node[2-3]")
    assert worker_step("42.0 bash node[1-2]\n") == ("42.0", "node[1-2]")
    assert worker_step("42.batch batch node1\n42.extern extern node[1-3]\n") is None  # between two steps
    assert worker_step("") is None


def test_a_warm_worker_is_found_while_alive_and_not_once_a_zombie(tmp_path: Path) -> None:
    """A warm process's forked worker (its registry record, its /proc stat naming the warm process as parent) is
    found while it runs; once dead but not yet reaped by the warm process (state Z, which a loaded machine leaves for
    a while) it is not: CI once saw a killed step's rank 0 still 'found' that way."""
    import json

    from megatron_hpc.warm_protocol import registered_workers

    run_dir, proc, warm = tmp_path / "run", tmp_path / "proc", tmp_path / "warm"
    run_dir.mkdir()
    warm.mkdir()
    (warm / "worker-0.json").write_text(json.dumps({"rank": 0, "pid": 200, "server_pid": 42,
                                                    "run_dir": os.path.realpath(run_dir)}))
    (proc / "200").mkdir(parents=True)
    for state, found in (("S", [(0, 200)]), ("Z", [])):
        (proc / "200" / "stat").write_text(f"200 (python3 (x)) {state} 42 200 200 0 -1\n")
        assert [(w.rank, w.pid) for w in registered_workers(warm, run_dir=run_dir, proc_root=proc)] == found
