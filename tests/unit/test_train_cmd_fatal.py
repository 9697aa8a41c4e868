"""`megatron-hpc train` tells the node task which failures a requeue cannot fix (fatal.json), and reads its run spec."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist
from megatron_hpc.launch.requeue import decide, read_outcome

from megatron_hpc.cli.train_cmd import is_deterministic
from megatron_hpc.config.loader import load_recipe
from megatron_hpc.errors import CheckpointError, ConfigError
from megatron_hpc.run_folder import write_spec
from megatron_hpc.train.entry import plan_for_torchrun

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_which_errors_a_retry_cannot_fix():
    for exc in (ConfigError("x"), CheckpointError("x"), ValueError("Invalid learning rate: -1.0"),
                TypeError("bad"), ZeroDivisionError("division by zero")):
        assert is_deterministic(exc), exc
    # A lost peer, a device fault or a flaky filesystem may pass on the next attempt.
    for exc in (RuntimeError("Connection reset by peer"), dist.DistBackendError("gloo timeout"),
                OSError(5, "Input/output error"), MemoryError()):
        assert not is_deterministic(exc), exc


def _train(run_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    return subprocess.run([sys.executable, "-m", "megatron_hpc", "train", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, env=env, timeout=300)


def test_a_run_folder_edited_after_planning_fails_once_and_is_not_requeued(tmp_path: Path):
    cfg = load_recipe("tiny", ["data.source=synthetic", "train.num_steps=1"])
    write_spec(tmp_path, plan_for_torchrun(cfg, environ={}))
    config = json.loads((tmp_path / "config.json").read_text())
    config["model"]["num_layers"] = 2  # the plan was made for 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = _train(tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("megatron-hpc: error: ")
    assert "changed after" in proc.stderr and "Traceback" not in proc.stderr
    fatal = json.loads((tmp_path / "fatal.json").read_text())
    assert fatal["kind"] == "PlanError" and "changed after" in fatal["error"]
    # What the node task then decides for a SLURM run phase: fail, not requeue.
    slurm = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0", "SLURM_NODEID": "0"}
    (tmp_path / "fatal.json").write_text(json.dumps({**fatal, "job_id": "7", "attempt": 0}))
    decision = decide(read_outcome(tmp_path, phase="run", exit_code=1, environ=slurm))
    assert decision.action == "fail" and "not requeued" in decision.message
