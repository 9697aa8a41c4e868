"""Time from a node failure to the first completed step after it: in-job restart on a hot spare against requeue.

Issue 28's figure (goal: in-job <= 0.3x requeue). On the local SLURM cluster (slurm/local-cluster-start.sh; export
its SLURM_CONF first), two-node `tiny` runs on synthetic tokens, one with `launch.spare_nodes=1` and one without,
alternating in the same invocation so that the machine's load hits both alike. Once a run has logged iteration
FAIL_AT (past the save at SAVE_EVERY), the second node of its step is made DOWN (`scontrol update state=down`, what
the controller concludes once a node stops answering; the node returns to service afterwards), and the script
polls every POLL_S for each event of the recovery:

    detection        failure -> SLURM reports it (srun's "Node failure" in the job's output, or the job leaves
                     RUNNING)
    teardown         -> the old step is gone and the launcher acts (in-job: the driver's restart line; requeue:
                     the job is back in the queue)
    new step start   -> node 0's node.sh starts the new step or attempt (its first log line)
    checkpoint load  -> the trainer logged "> loaded checkpoint"
    first step       -> the last rank logged the first iteration after it

    python benchmarks/in_job_restart.py --rounds 2 [--with-cold]

The in-job runs start their workers from warm processes (launch.warm_restart, the default); --with-cold adds a
third run per round with launch.warm_restart=false, whose steps start torchrun as before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

FAIL_AT, SAVE_EVERY, NUM_STEPS = 6, 4, 12
POLL_S = 0.05
TIMEOUT_S = 300
PHASES = ("detection", "teardown", "new step start", "checkpoint load", "first step")
IN_JOB, IN_JOB_COLD = "in-job restart", "in-job, torchrun"
"""With warm workers (launch.warm_restart, the default: the warm process forks the workers) and without."""


@dataclass
class Recovery:
    mode: str
    failed_at: float
    seen: dict[str, float] = field(default_factory=dict)

    def durations(self) -> dict[str, float]:
        out, last = {}, self.failed_at
        for phase in PHASES:
            out[phase] = self.seen[phase] - last
            last = self.seen[phase]
        return out

    @property
    def total(self) -> float:
        return self.seen[PHASES[-1]] - self.failed_at


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_")) or k == "SLURM_CONF"}


def job_fields(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(t.split("=", 1) for t in out.split() if "=" in t)


def submit(run_dir: Path, *, spares: int, warm: bool = True) -> str:
    sets = ["data.source=synthetic", f"train.num_steps={NUM_STEPS}", "train.log_interval=1", "compile.enabled=false",
            f"checkpoint.save_interval={SAVE_EVERY}", "train.tensorboard=false", f"launch.spare_nodes={spares}",
            f"launch.warm_restart={str(warm).lower()}"]
    cmd = [sys.executable, "-m", "megatron_hpc", "submit", "--recipe", "tiny", "--nodes", "2", "--platform", "cpu",
           "--cluster", "slurm", "--partition", "debug", "--json", "--out", str(run_dir)]
    proc = subprocess.run(cmd + [a for s in sets for a in ("--set", s)], capture_output=True, text=True,
                          env=_env(), timeout=120)
    if proc.returncode:
        raise SystemExit(f"submit failed: {proc.stderr.strip().splitlines()[-1]}")
    return json.loads(proc.stdout)["jobs"][0]["job_id"]


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _job_output(run_dir: Path) -> str:
    return "".join(_text(p) for p in sorted((run_dir / "logs").glob("*.out")))


def wait_for(predicate, what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(POLL_S)


def step_nodes(run_dir: Path) -> list[str]:
    for line in _job_output(run_dir).splitlines():
        if line.startswith("megatron-hpc: in-job: step 0 on "):
            return line.rsplit(" ", 1)[1].split(",")
    return []


def one_failure(run_dir: Path, *, spares: int, warm: bool = True) -> Recovery:
    job_id = submit(run_dir, spares=spares, warm=warm)
    log0, log1 = run_dir / "logs" / "run-node0.log", run_dir / "logs" / "run-node1.log"
    wait_for(lambda: f"iteration {FAIL_AT:8d}/" in _text(log1), f"iteration {FAIL_AT}")
    held = job_fields(job_id)["NodeList"]
    nodes = step_nodes(run_dir) if spares else subprocess.run(["scontrol", "show", "hostnames", held],
                                                             capture_output=True, text=True).stdout.split()
    lost = nodes[1]  # not the first node, where the batch script runs
    offsets = {"out": len(_job_output(run_dir)), "log0": len(_text(log0)), "log1": len(_text(log1))}
    rec = Recovery(mode=(IN_JOB if warm else IN_JOB_COLD) if spares else "requeue", failed_at=time.time())
    subprocess.run(["scontrol", "update", f"nodename={lost}", "state=down", "reason=benchmark"], check=True)
    try:
        _follow(rec, run_dir, job_id, offsets, in_job=bool(spares))
        wait_for(lambda: job_fields(job_id).get("JobState") not in ("RUNNING", "PENDING", "COMPLETING"), "the end")
    finally:
        _resume(lost)
    return rec


def _follow(rec: Recovery, run_dir: Path, job_id: str, offsets: dict[str, int], *, in_job: bool) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while len(rec.seen) < len(PHASES):
        if time.monotonic() > deadline:
            raise SystemExit(f"{rec.mode}: only saw {sorted(rec.seen)}")
        now = time.time()
        out = _job_output(run_dir)[offsets["out"]:]
        state = job_fields(job_id).get("JobState", "")
        log0 = _text(run_dir / "logs" / "run-node0.log")[offsets["log0"]:]
        log1 = _text(run_dir / "logs" / "run-node1.log")[offsets["log1"]:]
        loaded = log0.find("> loaded checkpoint")
        restarted = log1.find("megatron-hpc: run phase, node 1 of")  # iteration lines after it are the new step's
        checks = {
            "detection": "Node failure" in out or state not in ("RUNNING", ""),
            "teardown": "in-job: step 0 on" in out if in_job else state in ("PENDING", "REQUEUED", "CONFIGURING"),
            "new step start": "megatron-hpc: run phase, node 0 of" in log0,
            "checkpoint load": loaded >= 0,
            "first step": loaded >= 0 and restarted >= 0 and "iteration " in log1[restarted:],
        }
        for phase in PHASES:  # in order: a later event implies the earlier ones happened by now
            if phase not in rec.seen and checks[phase]:
                rec.seen[phase] = now
            if phase not in rec.seen:
                break
        time.sleep(POLL_S)


def _resume(node: str) -> None:
    for _ in range(120):
        state = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True).stdout.strip()
        if state in ("idle", "mix", "alloc"):
            return
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
        time.sleep(0.5)


def report(recoveries: list[Recovery]) -> list[str]:
    lines = [f"{'mode':<16}" + "".join(f"{p:>17}" for p in PHASES) + f"{'total':>10}"]
    for mode in (IN_JOB, IN_JOB_COLD, "requeue"):
        mine = [r for r in recoveries if r.mode == mode]
        if not mine:
            continue
        cells = [statistics.median(r.durations()[p] for r in mine) for p in PHASES]
        total = statistics.median(r.total for r in mine)
        lines.append(f"{mode:<16}" + "".join(f"{c:>16.2f}s" for c in cells) + f"{total:>9.2f}s")
    requeue = statistics.median(r.total for r in recoveries if r.mode == "requeue")
    rounds = sum(r.mode == "requeue" for r in recoveries)
    for mode, label in ((IN_JOB, "in-job"), (IN_JOB_COLD, "in-job, torchrun")):
        mine = [r.total for r in recoveries if r.mode == mode]
        if mine:
            lines.append(f"{label} / requeue: {statistics.median(mine) / requeue:.2f}x (goal <= 0.3x); medians of "
                         f"{rounds} round(s)")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--with-cold", action="store_true",
                        help="also an in-job restart with launch.warm_restart=false (torchrun starts each step)")
    args = parser.parse_args(argv)
    if not os.environ.get("SLURM_CONF") or subprocess.run(["scontrol", "ping"], capture_output=True).returncode:
        raise SystemExit("no SLURM controller answers: start slurm/local-cluster-start.sh and export its SLURM_CONF")
    recoveries = []
    with tempfile.TemporaryDirectory(prefix="in-job-bench-") as tmp:
        for i in range(args.rounds):
            for spares, warm in ((1, True), *(((1, False),) if args.with_cold else ()), (0, True)):
                rec = one_failure(Path(tmp) / f"{i}-{spares}-{warm}", spares=spares, warm=warm)
                print(f"round {i + 1} {rec.mode}: {rec.total:.2f} s", file=sys.stderr, flush=True)
                recoveries.append(rec)
    load = os.getloadavg()
    lines = [*report(recoveries), f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores"]
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
