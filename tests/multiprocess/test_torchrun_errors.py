"""An error every rank of a torchrun launch meets is printed once, not once per rank (cli/said_once.py)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess


def test_torchrun_evaluate_of_a_missing_checkpoint_says_it_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "megatron_hpc", "evaluate", str(tmp_path / "missing")],
                          capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode != 0
    said = [line for line in proc.stderr.splitlines() if line.startswith("megatron-hpc: error:")]
    assert len(said) == 1, proc.stderr[-3000:]
    assert str(tmp_path / "missing") in said[0]
