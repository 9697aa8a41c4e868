"""Hang debugging on real processes: `megatron-hpc debug` gets the stacks of every rank of a running
run (py-spy and the SIGUSR1/faulthandler fallback), and launch.collective_timeout_s turns a rank that
stops answering into a failure instead of a hang.

The run folder comes from `submit --dry-run`; its generated node script starts torchrun with two gloo
workers, exactly as on a node.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from local_runs import local_env, start_local_run, wait_for_iteration

pytestmark = pytest.mark.multiprocess

SETS = ["data.source=synthetic", "launch.workers_per_node=2", "parallel.tensor=1", "train.num_steps=100000",
        "train.log_interval=1", "checkpoint.save_interval=0", "compile.enabled=false", "model.num_layers=1",
        "train.tensorboard=false", "train.eval_interval=0", "launch.collective_timeout_s=8"]


def _start(tmp_path: Path) -> tuple[Path, subprocess.Popen]:
    out = tmp_path / "run"
    return out, start_local_run(out, SETS)


def _debug(run_dir: Path, method: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "megatron_hpc", "debug", str(run_dir), "--method", method,
                           "--json"], capture_output=True, text=True, timeout=120, env=local_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@pytest.mark.parametrize("method", ["signal", "py-spy"])
def test_debug_collects_every_ranks_stacks(tmp_path: Path, method: str, worker_pids) -> None:
    if method == "py-spy":
        assert shutil.which("py-spy"), "py-spy is part of the test extra (setup.cfg); install it with .[test]"
    run_dir, proc = _start(tmp_path)
    try:
        lines: list[str] = []
        wait_for_iteration(proc, 3, lines)
        report = _debug(run_dir, method)
        pids = worker_pids(run_dir)
        assert report["world_size"] == 2 and report["missing"] == []
        assert {r["rank"]: r["pid"] for r in report["ranks"]} == pids
        for item in report["ranks"]:
            assert item["method"] == method and item["error"] is None
            # Both are inside the training loop of our trainer, and the report says where.
            assert "megatron_hpc/train/loop.py" in item["stacks"], item["stacks"]
        assert sorted(r for g in report["groups"] for r in g["ranks"]) == [0, 1]
        text = Path(report["report_file"]).read_text()
        assert "stacks of 2/2 ranks" in text and "===== rank 1" in text
        assert proc.poll() is None  # dumping did not disturb the run
    finally:
        _kill(proc)


def test_a_rank_that_stops_answering_fails_the_run_instead_of_hanging(tmp_path: Path, worker_pids) -> None:
    run_dir, proc = _start(tmp_path)
    try:
        lines: list[str] = []
        wait_for_iteration(proc, 2, lines)
        pids = worker_pids(run_dir)
        os.kill(pids[1], signal.SIGSTOP)  # rank 1 hangs; rank 0 waits in its next collective
        rest = proc.communicate(timeout=240)[0]  # a limit that keeps a broken run from hanging the tier, no more
        assert proc.returncode != 0
        # The 8 s collective timeout ended it, not the 30-minute default: gloo names the timeout that expired (read
        # from the run's output rather than a wall clock, which a loaded machine stretches).
        assert "Timed out waiting 8000ms" in rest, rest[-3000:]
    finally:
        _kill(proc)
