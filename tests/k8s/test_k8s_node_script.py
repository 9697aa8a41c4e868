"""The node script a PyTorchJob pod runs (the ConfigMap's node.sh), run here with a stand-in torchrun: it takes the
node count from the pod's environment and the rank, master address and port from the training operator's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from megatron_hpc.launch.k8s_submit import state_from_conditions

from megatron_hpc.cli.main import main

FAKE_TORCHRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$TORCHRUN_ARGS"
"""


def test_pod_node_script_starts_torchrun_with_the_operators_rank_and_master(tmp_path):
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "torchrun").write_text(FAKE_TORCHRUN)
    (stub / "torchrun").chmod(0o755)
    for tool in ("python", "megatron-hpc"):
        (stub / tool).symlink_to(Path(sys.executable).parent / tool)
    shared = tmp_path / "claim"
    out = tmp_path / "k"
    assert main(["submit", "--recipe", "gpt2_small", "--nodes", "4", "--cluster", "k8s", "--dry-run", "--out",
                 str(out), "--set", "data.source=synthetic", "--set", "k8s.volume_claim=c", "--set", "k8s.image=i",
                 "--set", f"k8s.mount_path={shared}", "--set", f"k8s.bin_dir={stub}"]) == 0
    files = yaml.safe_load((out / "configmap.yaml").read_text())["data"]
    run_dir = shared / "runs" / "gpt2_small" / "k"
    run_dir.mkdir(parents=True)
    for name in ("config.json", "plan.json", "compile-fingerprint.json"):  # what the pod's command copies in
        (run_dir / name).write_text(files[name])
    (tmp_path / "node.sh").write_text(files["node.sh"])
    env = {"PATH": f"{stub}:/usr/bin:/bin", "HOME": str(tmp_path), "TORCHRUN_ARGS": str(tmp_path / "args"),
           "RANK": "2", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "23456", "MEGATRON_HPC_K8S_NNODES": "4",
           "HOSTNAME": "gpt2-small-k-run-worker-1", "MEGATRON_HPC_LOCAL_CACHE_DIR": str(tmp_path / "local")}
    assert "SLURM_JOB_ID" not in env
    proc = subprocess.run(["bash", str(tmp_path / "node.sh"), "run"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = (tmp_path / "args").read_text().split()
    nproc = json.loads((run_dir / "plan.json").read_text())["workers_per_node"]
    for expected in ("--nnodes=4", "--node_rank=2", "--master_addr=10.1.2.3", "--master_port=23456",
                     f"--nproc_per_node={nproc}"):
        assert expected in args
    assert args[args.index("--run-dir") + 1] == str(run_dir)
    log = (run_dir / "logs" / "run-node2.log").read_text()
    assert "node 2 of 4, master 10.1.2.3:23456" in log and "run phase finished" in log
    assert "MEGATRON_HPC_K8S_NNODES" not in os.environ


def test_job_states_from_conditions():
    assert state_from_conditions([]) == "PENDING"
    created = {"type": "Created", "status": "True"}
    running = {"type": "Running", "status": "True"}
    assert state_from_conditions([created, running]) == "RUNNING"
    assert state_from_conditions([created, {**running, "status": "False"}, {"type": "Succeeded", "status": "True"}]) \
        == "COMPLETED"
    assert state_from_conditions([created, running, {"type": "Restarting", "status": "True"}]) == "RUNNING"
    assert state_from_conditions([created, {"type": "Failed", "status": "True"}]) == "FAILED"
    assert state_from_conditions([{"type": "Complete", "status": "True"}]) == "COMPLETED"  # a batch/v1 Job
