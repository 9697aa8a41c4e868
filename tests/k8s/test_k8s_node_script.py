"""The node script a PyTorchJob pod runs (the ConfigMap's node.sh), run here with a stand-in torchrun: it takes the
node count from the pod's environment and the rank, master address and port from the training operator's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from megatron_hpc.launch.k8s_api import state_from_conditions

from megatron_hpc.cli.main import main

FAKE_TORCHRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$TORCHRUN_ARGS"
"""


def stub_bin(tmp_path: Path) -> Path:
    """k8s.bin_dir of the pods: a stand-in torchrun, and this Python's python and megatron-hpc."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "torchrun").write_text(FAKE_TORCHRUN)
    (stub / "torchrun").chmod(0o755)
    # Wrappers, not symlinks: a symlinked python outside its venv folder would not find the venv.
    for tool, argv in (("python", sys.executable), ("megatron-hpc", f"{sys.executable} -m megatron_hpc")):
        (stub / tool).write_text(f'#!/usr/bin/env bash\nexec {argv} "$@"\n')
        (stub / tool).chmod(0o755)
    return stub


def render_pods(tmp_path: Path, out: Path, *extra: str) -> tuple[Path, Path]:
    """Render a 4-node gpt2_small run with the claim at tmp_path/claim; put the ConfigMap's spec into the run folder
    on the claim as the pods' command does; returns (node.sh, run folder)."""
    shared = tmp_path / "claim"
    assert main(["submit", "--recipe", "gpt2_small", "--nodes", "4", "--cluster", "k8s", "--dry-run", "--out",
                 str(out), "--set", "data.source=synthetic", "--set", "k8s.volume_claim=c", "--set", "k8s.image=i",
                 "--set", f"k8s.mount_path={shared}", "--set", f"k8s.bin_dir={tmp_path / 'bin'}", *extra]) == 0
    files = yaml.safe_load((out / "configmap.yaml").read_text())["data"]
    run_dir = shared / "runs" / "gpt2_small" / out.name
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "plan.json", "compile-fingerprint.json"):
        (run_dir / name).write_text(files[name])
    node_sh = out / "node-in-pod.sh"
    node_sh.write_text(files["node.sh"])
    return node_sh, run_dir


def pod_env(tmp_path: Path, *, rank: int) -> dict[str, str]:
    """What a pod's container sees: our env (NNODES, local cache folder) and the training operator's."""
    return {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path),
            "TORCHRUN_ARGS": str(tmp_path / f"args{rank}"), "RANK": str(rank), "MASTER_ADDR": "10.1.2.3",
            "MASTER_PORT": "23456", "MEGATRON_HPC_K8S_NNODES": "4", "HOSTNAME": f"pod-{rank}",
            "MEGATRON_HPC_LOCAL_CACHE_DIR": str(tmp_path / f"local{rank}")}


def test_pod_node_script_starts_torchrun_with_the_operators_rank_and_master(tmp_path):
    stub_bin(tmp_path)
    node_sh, run_dir = render_pods(tmp_path, tmp_path / "k")
    env = pod_env(tmp_path, rank=2)
    assert "SLURM_JOB_ID" not in env
    proc = subprocess.run(["bash", str(node_sh), "run"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = (tmp_path / "args2").read_text().split()
    nproc = json.loads((run_dir / "plan.json").read_text())["workers_per_node"]
    for expected in ("--nnodes=4", "--node_rank=2", "--master_addr=10.1.2.3", "--master_port=23456",
                     f"--nproc_per_node={nproc}"):
        assert expected in args
    assert args[args.index("--run-dir") + 1] == str(run_dir)
    log = (run_dir / "logs" / "run-node2.log").read_text()
    assert "node 2 of 4, master 10.1.2.3:23456" in log and "run phase finished" in log
    assert "MEGATRON_HPC_K8S_NNODES" not in os.environ


def test_a_compile_job_on_every_pod_records_the_fingerprint_and_the_next_submit_skips_it(tmp_path):
    stub_bin(tmp_path)
    compile_on = ("--set", "train.compile=true")
    node_sh, run_dir = render_pods(tmp_path, tmp_path / "first", *compile_on)
    assert (tmp_path / "first" / "compile-pytorchjob.yaml").exists()
    pods = [subprocess.Popen(["bash", str(node_sh), "compile"], env=pod_env(tmp_path, rank=rank), cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(4)]
    said = [pod.communicate(timeout=300)[0] for pod in pods]
    assert [pod.returncode for pod in pods] == [0, 0, 0, 0], said
    assert any("recorded compile fingerprint" in text for text in said), said
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [f"compile-node{n}.log" for n in range(4)]
    render_pods(tmp_path, tmp_path / "second", *compile_on)
    assert not (tmp_path / "second" / "compile-pytorchjob.yaml").exists()
    assert (tmp_path / "second" / "pytorchjob.yaml").exists()


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


def test_status_of_a_k8s_run_reads_progress_on_the_claim_and_says_without_a_context(tmp_path, monkeypatch, capsys):
    """submission.json as a real submit writes it; no cluster, so the states are the recorded ones."""
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    stub_bin(tmp_path)
    out = tmp_path / "runs" / "gpt2_small" / "r1"
    _, run_dir = render_pods(tmp_path, out)
    (out / "submission.json").write_text(json.dumps({"cluster": "k8s", "ok": True, "reason": "", "jobs": [
        {"phase": "run", "job_id": "pytorchjob/gpt2-small-r1-run", "state": "PENDING", "depends_on": None}]}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"iteration": 7, "phase": "run", "lm_loss": 4.5,
                                                       "elapsed_ms": 100.0, "tokens_per_s": 10.0}) + "\n")
    capsys.readouterr()
    assert main(["status", str(out), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["cluster"] == "k8s" and status["progress"]["iteration"] == 7
    assert status["jobs"] == [{"phase": "run", "job_id": "pytorchjob/gpt2-small-r1-run", "state": "PENDING",
                               "nodes": "", "restarts": 0, "source": "submit (no kube context)"}]
    assert main(["cancel", str(out)]) == 1
    assert "no kube context" in capsys.readouterr().err


HANGING_TORCHRUN = """#!{python}
# A stand-in torchrun whose one worker beats once, past the warm-up, and then hangs.
import os, subprocess, sys
args = sys.argv[1:]
opt = {{a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if a.startswith("--") and "=" in a}}
rank = int(opt["--node_rank"]) * int(opt["--nproc_per_node"])
env = {{**os.environ, "RANK": str(rank), "GROUP_RANK": opt["--node_rank"]}}
worker = subprocess.run([sys.executable, "-c", {worker!r}, *args[args.index("-m"):]], env=env)
sys.exit(worker.returncode if worker.returncode >= 0 else 128 - worker.returncode)
"""
HANGING_WORKER = """
import os, sys, time
from pathlib import Path
from megatron_hpc.debug_stacks import register_stack_dump
from megatron_hpc.heartbeat import HeartbeatWriter
run_dir, rank = Path(sys.argv[sys.argv.index("--run-dir") + 1]), int(os.environ["RANK"])
register_stack_dump(run_dir, rank)
HeartbeatWriter(run_dir, rank, host=os.environ["HOSTNAME"]).beat("forward-backward", 5, step_s=0.1)
time.sleep(600)
"""


def test_a_hung_pod_fails_with_a_hang_report_so_that_on_failure_restarts_it(tmp_path):
    stub_bin(tmp_path)
    (tmp_path / "bin" / "torchrun").write_text(HANGING_TORCHRUN.format(python=sys.executable, worker=HANGING_WORKER))
    node_sh, run_dir = render_pods(tmp_path, tmp_path / "k", "--set", "launch.hang_timeout_s=2")
    proc = subprocess.run(["bash", str(node_sh), "run"], env=pod_env(tmp_path, rank=1), capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0, proc.stdout + proc.stderr  # restartPolicy OnFailure restarts the pod
    [report] = [json.loads(p.read_text()) for p in (run_dir / "hangs").glob("*.json")]
    rank = json.loads((run_dir / "plan.json").read_text())["workers_per_node"]  # node 1's first rank
    assert report["timeout_s"] == 2 and report["job_id"] == "pod-1"
    assert report["ranks"][str(rank)]["iteration"] == 5 and report["ranks"][str(rank)]["host"] == "pod-1"
    # The node's other ranks never beat: they were not where rank `rank` was.
    assert rank not in report["suspect_ranks"] and rank + 1 in report["suspect_ranks"]
    stacks = Path(report["stacks"][0]).read_text()
    # Through SIGUSR1 and faulthandler (no py-spy on the pod's PATH): the worker's main thread, in its sleep.
    section = stacks.split(f"===== rank {rank} ")[1]
    assert "signal) =====" in section.splitlines()[0] and 'File "<string>"' in section and "(error" not in section
    assert "watchdog: hang report" in (run_dir / "logs" / "run-node1.log").read_text()
