"""submission.json is written as soon as jobs are queued: a `submit --wait` interrupted while it follows them
(Ctrl-C, a closed terminal) leaves jobs that `status`, `cancel` and a resume's still-active check must know of.

Real processes and a real SIGINT; the SLURM commands are stand-ins, named as such, that queue nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Stand-ins for the SLURM client commands: sbatch hands out job ids 101, 102, ...; scontrol says every job runs
# (and notes that someone asked, so the test knows `submit --wait` is following the jobs); scancel notes its ids.
SLURM_STAND_INS = {
    "sbatch": 'n=$(( $(cat "$STAND_IN_DIR/next" 2>/dev/null || echo 100) + 1 )); echo "$n" > "$STAND_IN_DIR/next"\n'
              'echo "$n"',
    "scontrol": 'case "$1" in\n'
                '  ping) echo "Slurmctld(primary) at ctl is UP" ;;\n'
                '  show) touch "$STAND_IN_DIR/followed"; echo "JobId=$4 JobState=RUNNING Restarts=0 NodeList=n1" ;;\n'
                'esac',
    "scancel": 'echo "$@" >> "$STAND_IN_DIR/scancel"',
    "srun": "exit 0",
    "sacct": "exit 0",
    "sinfo": "exit 0",
}


def _stand_ins(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, body in SLURM_STAND_INS.items():
        (bin_dir / tool).write_text(f"#!/bin/sh\n# A stand-in for SLURM's {tool}.\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "MEGATRON_HPC_CLUSTER"))}
    return {**env, "PATH": f"{bin_dir}:{env['PATH']}", "STAND_IN_DIR": str(tmp_path), "HOME": str(tmp_path),
            "MEGATRON_HPC_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}


def _terminal_sigint() -> None:
    # A terminal's shell starts commands with SIGINT at its default; a suite run in the background (a non-interactive
    # shell's `&`, as tests/run.sh runs tiers and CI may run it) hands its children SIGINT ignored, and Python then
    # never raises KeyboardInterrupt: the Ctrl-C under test would not arrive.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_an_interrupted_submit_wait_leaves_the_queued_jobs_recorded(tmp_path):
    env, run_dir = _stand_ins(tmp_path), tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_hpc", "submit", "--recipe", "tiny", "--cluster", "slurm",
                             "--wait", "--set", "data.source=synthetic", "--out", str(run_dir)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_terminal_sigint)
    deadline = time.monotonic() + 120
    while not (tmp_path / "followed").exists():  # queued; now following the jobs
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    queued = (tmp_path / "next").read_text().split()
    record = json.loads((run_dir / "submission.json").read_text())
    assert [j["job_id"] for j in record["jobs"]] == [str(n) for n in range(101, int(queued[0]) + 1)]
    assert record["cluster"] == "slurm"
    cancel = subprocess.run([sys.executable, "-m", "megatron_hpc", "cancel", str(run_dir)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert cancel.returncode == 0, cancel.stderr
    assert (tmp_path / "scancel").read_text().split() == [j["job_id"] for j in record["jobs"]]
