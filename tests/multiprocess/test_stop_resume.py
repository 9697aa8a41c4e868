"""A run signalled mid-way saves, and resumed it ends exactly as a run that was never interrupted.

Real processes all the way: `submit --dry-run` writes the run folder, the generated node script
starts torchrun with two gloo workers (TP 2), and the test sends SIGUSR2 to ONE worker only. Both
ranks must agree to stop after the same iteration, save it, and leave stopped.json; starting the
node script again resumes from that checkpoint and finishes with the losses of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

NUM_STEPS = 40
# Half the tiny recipe's width, a quarter of its vocabulary and positions: a step of about 0.1 s instead of 0.6 s
# on two shared cores, and still 35 of them left when the signal is sent at iteration 5.
SETS = ["data.source=synthetic", "launch.workers_per_node=2", "parallel.tensor=2", f"train.num_steps={NUM_STEPS}",
        "train.log_interval=1", "checkpoint.save_interval=1000", "compile.enabled=false", "model.num_layers=2",
        "model.hidden_size=128", "model.vocab_size=2048", "model.seq_length=64", "model.max_position_embeddings=64",
        "train.tensorboard=false", "train.eval_interval=0"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _dry_run(out: Path, extra: list[str] = ()) -> Path:
    args = [sys.executable, "-m", "megatron_hpc", "submit", "--recipe", "tiny", "--dry-run", "--out", str(out)]
    for item in [*SETS, *extra]:
        args += ["--set", item]
    subprocess.run(args, check=True, capture_output=True, env=_env())
    return out


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["lm_loss"] for r in rows if r.get("phase", "run") == "run" and "lm_loss" in r}


def _node_script(run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(run_dir / "node.sh"), "run"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True,
                            preexec_fn=_terminal_sigint)


def _terminal_sigint() -> None:
    # SIGINT at its default, as a terminal's shell starts commands: the multiprocess tier runs in the background of
    # tests/run.sh, whose children inherit SIGINT ignored, and the Ctrl-C test's signal would not arrive.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_signal_to_one_rank_stops_all_at_one_iteration_and_resume_matches(tmp_path, worker_pids):
    straight = _dry_run(tmp_path / "straight")
    interrupted = _dry_run(tmp_path / "interrupted")

    proc = _node_script(interrupted)
    lines: list[str] = []
    signalled_at = None
    for line in proc.stdout:
        lines.append(line)
        if signalled_at is None and "iteration        5/" in line:
            pids = worker_pids(interrupted)
            assert sorted(pids) == [0, 1], pids
            os.kill(pids[1], signal.SIGUSR2)  # rank 1 only: rank 0 learns it through the collective check
            signalled_at = time.monotonic()
    code = proc.wait(timeout=300)
    log = "".join(lines)
    assert signalled_at is not None, log[-3000:]
    stopped = json.loads((interrupted / "stopped.json").read_text())
    k = stopped["iteration"]
    assert 5 <= k < NUM_STEPS, log[-3000:]
    assert stopped["reason"] == "signal SIGUSR2 on another rank"  # rank 0 writes it and was not signalled
    assert code != 0 and "submit --resume" in log  # outside SLURM nobody requeues: it says how to go on
    ckpts = interrupted / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == str(k)
    assert sorted(p.name for p in (ckpts / f"iter_{k:07d}").iterdir() if p.is_dir()) == ["mp_rank_00",
                                                                                           "mp_rank_01"]
    assert max(_losses(interrupted)) == k

    resumed = _node_script(interrupted)
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out[-3000:]
    assert f"at iteration {k}" in out  # "> loaded checkpoint ... at iteration k"
    full = _node_script(straight)
    out_full, _ = full.communicate(timeout=300)
    assert full.returncode == 0, out_full[-3000:]

    expected, got = _losses(straight), _losses(interrupted)
    assert max(got) == NUM_STEPS
    for it in range(k + 1, NUM_STEPS + 1):
        assert got[it] == pytest.approx(expected[it], rel=1e-6, abs=0), it


def test_time_budget_stops_and_saves(tmp_path):
    run = _dry_run(tmp_path / "budget", ["launch.workers_per_node=1", "parallel.tensor=1",
                                         "checkpoint.time_budget_min=0.002"])  # 0.12 s of training
    proc = _node_script(run)
    out, _ = proc.communicate(timeout=300)
    stopped = json.loads((run / "stopped.json").read_text())
    assert stopped["reason"].startswith("time budget"), out[-2000:]
    k = stopped["iteration"]
    assert 1 <= k < NUM_STEPS
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(k)


def test_ctrl_c_on_a_local_run_keeps_the_workers_last_words_in_the_node_log(tmp_path, worker_pids):
    # A terminal's Ctrl-C sends SIGINT to every process of the foreground group: node.sh, torchrun, the workers and
    # the tee that writes the node log. A tee dying of it loses everything said after it (why each process ended)
    # and turns the workers' next print into a broken pipe.
    run = _dry_run(tmp_path / "ctrl-c", ["launch.workers_per_node=1", "parallel.tensor=1", "train.num_steps=100000"])
    proc = _node_script(run)  # its own session: the group a terminal would signal
    for line in proc.stdout:
        if "iteration        3/" in line:
            break
    os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=300)
    deadline = time.monotonic() + 120
    while worker_pids(run) and time.monotonic() < deadline:
        time.sleep(0.2)
    log = (run / "logs" / "run-node0.log").read_text()
    assert "megatron-hpc: interrupted" in log, log[-3000:]  # the worker's own last line, after the Ctrl-C
