"""On the real local SLURM cluster: once a compile phase succeeded, the same run skips it; a run
whose graphs differ (another batch size) does not. Each phase works in a node-local cache under
$TMPDIR, synced from the shared cache before and removed after. On CPU the compiler is torch.compile
(train.compile=true): without it there is no compile phase to skip."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

# One layer: inductor's first compile (the compile phase's, cold by design) took 46 s of CPU at tiny's four layers
# and 25 s at one; nothing here depends on the depth.
SETS = ["data.source=synthetic", "train.num_steps=4", "compile.num_steps=2", "train.log_interval=1",
        "train.tensorboard=false", "train.compile=true", "model.num_layers=1"]


def submit(run_dir: Path, *extra: str, tmpdir: Path, wait: bool = True) -> dict:
    cmd = [sys.executable, "-m", "megatron_hpc", "submit", "--recipe", "tiny", "--nodes", "1", "--platform", "cpu",
           "--cluster", "slurm", "--partition", "debug", "--json", "--out", str(run_dir), *(["--wait"] if wait else [])]
    for item in [*SETS, *extra]:
        cmd += ["--set", item]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_")) or k == "SLURM_CONF"}
    env["TMPDIR"] = str(tmpdir)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def node_local_caches(log: Path) -> list[str]:
    """The node-local caches a phase's node script says it used."""
    return re.findall(r"^megatron-hpc: compile cache (\S+) \(shared: ", log.read_text(), flags=re.MULTILINE)


def test_second_submit_skips_the_compile_job(slurm_cluster, sacct_job, tmp_path, own_compile_cache):
    tmpdir = tmp_path / "node-tmp"
    tmpdir.mkdir()
    first = submit(tmp_path / "first", tmpdir=tmpdir)
    assert [j["phase"] for j in first["jobs"]] == ["compile", "run"] and not first["compile_skipped"]
    markers = list((own_compile_cache / "megatron-hpc" / "fingerprints").glob("*.json"))
    assert [m.stem for m in markers] == [first["fingerprint"]]
    assert json.loads(markers[0].read_text())["job_id"] == first["jobs"][0]["job_id"]
    (local,) = node_local_caches(tmp_path / "first" / "logs" / "compile-node0.log")
    assert Path(local).name.startswith(f"megatron-hpc-cache.{first['jobs'][0]['job_id']}.node0.")
    assert not Path(local).exists()  # removed at the end of the phase

    # what the first run compiled and published reaches the skipped run's node-local cache before torchrun
    assert any(p.is_file() for p in (own_compile_cache / "inductor").rglob("*"))
    second = submit(tmp_path / "second", "train.num_steps=6", "optim.lr=5e-4", tmpdir=tmpdir)  # same graphs
    assert second["compile_skipped"] and second["fingerprint"] == first["fingerprint"]
    (run,) = second["jobs"]
    assert run["phase"] == "run" and run["depends_on"] is None
    assert sacct_job(run["job_id"], final=True)["State"] == "COMPLETED"
    assert not (tmp_path / "second" / "logs" / "compile-node0.log").exists()
    run_log = (tmp_path / "second" / "logs" / "run-node0.log").read_text()
    copied = re.search(r"^inductor: ([1-9]\d*) copied", run_log, flags=re.MULTILINE)
    assert copied and copied.start() < run_log.index("> megatron-hpc run:"), run_log
    # it compiled nothing new, so its publish said nothing (node.sh is quiet when nothing is copied)
    assert run_log.count("inductor: ") == 1, run_log

    assert not list(tmpdir.glob("megatron-hpc-cache.*"))

    # other graphs: both phases are queued again (cancelled here, the first submit showed them run)
    third = submit(tmp_path / "third", "train.global_batch_size=16", tmpdir=tmpdir, wait=False)
    subprocess.run(["scancel", *(j["job_id"] for j in third["jobs"])], check=True)
    assert not third["compile_skipped"] and third["fingerprint"] != first["fingerprint"]
    compile_job, run_job = third["jobs"]
    assert (compile_job["phase"], run_job["phase"]) == ("compile", "run")
    assert run_job["depends_on"] == compile_job["job_id"]
    for job in third["jobs"]:  # gone before the next test uses the cluster
        assert sacct_job(job["job_id"], timeout=60, final=True)["State"].startswith("CANCELLED")
