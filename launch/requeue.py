"""After a phase ends on a node: finish, fail, or requeue the SLURM job so that it resumes.

The node script runs `python -m megatron_hpc.launch.requeue` once torchrun has exited, in jobs
submitted by `submit` and in dry-run scripts submitted by hand alike. Requeueing keeps the job id
(`scontrol requeue`), SLURM starts it again with SLURM_RESTART_COUNT + 1, and the trainer resumes from
the newest complete checkpoint.

- The trainer stopped early (stopped.json of this attempt: SLURM's warning signal, SIGTERM, or the
  time budget) after saving: node 0 requeues, up to the limit.
- The phase failed without a fatal.json (a crash, a lost peer, an OOM kill): a run phase is requeued
  by the failing node, up to the limit. Our own errors (config, data, checkpoint) write fatal.json and
  are never retried; a compile phase that fails is never retried either (the run job is cancelled).
- A job that is no longer RUNNING (cancelled by a person, or already requeued by SLURM) is left alone.
- An in-job step (hot spares: MEGATRON_HPC_IN_JOB_STEP set by launch/in_job.py): nothing is decided here;
  the node records how its part ended (launch/step_exit.py) and the driver decides.
- A compile phase that succeeded on every node, its node-local caches published, records its compile
  fingerprint in the shared cache (record_fingerprint): later submits of the same graphs skip it.

No torch import: this runs on every node after the workers are gone.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_hpc.compile_cache import fingerprint
from megatron_hpc.launch.step_exit import (
    IN_JOB_STEP_ENV,
    node_exit_from_log,
    read_node_exits,
    step_folder,
    write_node_exit,
)

from megatron_hpc.errors import MegatronHpcError
from megatron_hpc.run_folder import (
    PLAN_FILE,
    PUBLISHED_DIR,
    AttemptRecord,
    FingerprintRecord,
    append_attempt,
    read_json,
)
from megatron_hpc.run_markers import FatalMarker, StoppedMarker, job_attempt, read_fatal, read_stopped

DEFAULT_MAX_REQUEUES = 3
MAX_REQUEUES_ENV = "MEGATRON_HPC_MAX_REQUEUES"
"""The requeue cap on the nodes: node.sh exports the cluster profile's max_requeues under this name."""
Action = Literal["done", "requeue", "fail"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    phase: str
    exit_code: int
    node_rank: int
    attempt: int
    """SLURM_RESTART_COUNT: how many times this job was requeued already."""
    max_requeues: int
    on_slurm: bool
    stopped: StoppedMarker | None = None
    fatal: FatalMarker | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    action: Action
    message: str


def decide(o: Outcome) -> Decision:
    """What to do with the job after this node's phase ended. Pure."""
    room = o.attempt < o.max_requeues
    limit = (f"requeue limit of {o.max_requeues} reached (raise max_requeues in the cluster profile, or set "
             f"{MAX_REQUEUES_ENV} where you submit; default {DEFAULT_MAX_REQUEUES})")
    if o.stopped is not None:
        where = f"at iteration {o.stopped.iteration} on {o.stopped.reason}"
        saved = o.stopped.checkpoint or "no checkpoint"
        if not o.on_slurm:
            return Decision(action="fail", message=f"stopped {where} ({saved}); continue with "
                                                   "`megatron-hpc submit --resume RUN`")
        if o.node_rank != 0:
            return Decision(action="done", message=f"stopped {where}; node 0 requeues the job")
        if not room:
            return Decision(action="fail", message=f"stopped {where} ({saved}); not requeued: {limit}; "
                                                   "continue with `megatron-hpc submit --resume RUN`")
        return Decision(action="requeue", message=f"stopped {where} ({saved}); requeueing to resume "
                                                  f"(requeue {o.attempt + 1} of {o.max_requeues})")
    if o.exit_code == 0:
        return Decision(action="done", message=f"{o.phase} phase finished")
    failed = f"{o.phase} phase failed (exit {o.exit_code})"
    if o.fatal is not None:
        # The trainer printed the error itself (`megatron-hpc: error: ...`); its first line is repeated here
        # so that the node's last word names the cause, not only its type.
        error = o.fatal.error.strip().splitlines()
        cause = f"{o.fatal.kind}: {error[0]}" if error else o.fatal.kind
        return Decision(action="fail", message=f"{failed}: {cause}; not requeued, a retry would fail the same way")
    if o.phase != "run" or not o.on_slurm:
        return Decision(action="fail", message=failed)
    if not room:
        return Decision(action="fail", message=f"{failed}; not requeued: {limit}")
    return Decision(action="requeue", message=f"{failed}; requeueing to resume from the last checkpoint "
                                              f"(requeue {o.attempt + 1} of {o.max_requeues})")


def read_outcome(run_dir: Path, *, phase: str, exit_code: int, environ: dict[str, str] | None = None,
                 node_rank: int | None = None) -> Outcome:
    """`node_rank` is node.sh's NODE_RANK; None takes SLURM_NODEID (0 outside SLURM)."""
    env = dict(os.environ if environ is None else environ)
    limit = env.get(MAX_REQUEUES_ENV, "")
    if node_rank is None:
        node_rank = int(env.get("SLURM_NODEID", "0") or 0)
    return Outcome(phase=phase, exit_code=exit_code, node_rank=node_rank,
                   attempt=job_attempt(env)["attempt"],
                   max_requeues=int(limit) if limit.isdigit() else DEFAULT_MAX_REQUEUES,
                   on_slurm=bool(env.get("SLURM_JOB_ID")),
                   stopped=read_stopped(run_dir, env) if phase == "run" else None,
                   fatal=read_fatal(run_dir, env))


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job` (the controller's live view) as a dict; empty when it cannot say."""
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(tok.split("=", 1) for tok in proc.stdout.split() if "=" in tok)


SCONTROL_TIMEOUT_S = 60.0
"""How long `scontrol requeue` may take before the requeue counts as not done."""


def requeue(job_id: str, *, attempt: int) -> tuple[bool, str]:
    """`scontrol requeue JOB` when this attempt is the job's current one and it is RUNNING; (done, why not).

    A step left running on a lost node outlives its attempt: by the time it fails, SLURM may have
    requeued and restarted the job, and requeueing it again would kill the healthy new attempt.
    """
    fields = job_fields(job_id)
    state, restarts = fields.get("JobState"), fields.get("Restarts", "")
    if restarts.isdigit() and int(restarts) != attempt:
        return False, f"job {job_id} is on attempt {restarts} already, this was attempt {attempt}: left as it is"
    if state != "RUNNING":
        return False, f"job {job_id} is {state or 'unknown to scontrol'}, not RUNNING: left as it is"
    try:
        proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:  # the in-job driver must live on to record the attempt
        return False, f"`scontrol requeue {job_id}` did not answer ({exc})"
    if proc.returncode != 0:
        return False, f"`scontrol requeue {job_id}` failed: {(proc.stderr or proc.stdout).strip()}"
    return True, ""


def record_attempt(run_dir: Path, outcome: Outcome, decision: Decision, *, requeued: bool) -> None:
    """One line per node-0 phase end, for `status` and for people reading the run folder."""
    attempt = job_attempt()
    append_attempt(run_dir, AttemptRecord(
        time=time.time(), phase=outcome.phase, job_id=attempt["job_id"], attempt=attempt["attempt"],
        exit_code=outcome.exit_code, action=decision.action, requeued=requeued, message=decision.message,
        iteration=outcome.stopped.iteration if outcome.stopped else None))


PUBLISH_WAIT_S = 120.0
"""How long a node that published looks for the others' files: covers NFS attribute caching (<= 60 s)."""


def record_fingerprint(run_dir: Path, *, node_rank: int, environ: dict[str, str] | None = None,
                       wait_s: float = PUBLISH_WAIT_S) -> Path | None:
    """Note that this node's compile phase succeeded and published; once every node has, record the fingerprint.

    Called only after node.sh published this node's cache (the exit code passed in counts a failed publish),
    so the marker in the shared cache never names graphs that are not there. Each node compiles the graphs its
    own trial met (neuron-xla.md 2.5), so all nodes must have published. The last node to get here finds every
    node's file and records (the marker is written atomically, so two nodes finding them at once is harmless);
    a node that failed writes none, and then nothing is recorded. Returns the marker, or None.
    """
    try:
        fp = FingerprintRecord.read(run_dir)
        num_nodes = int(read_json(run_dir / PLAN_FILE).get("num_nodes", 1))
    except (OSError, ValueError, TypeError, KeyError):
        return None  # a run folder written by hand or by an older version: nothing to record
    attempt = job_attempt(environ)
    folder = run_dir / PUBLISHED_DIR / f"{attempt['job_id'] or 'local'}.{attempt['attempt']}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"node{node_rank}").touch()
    deadline = time.monotonic() + wait_s
    while missing := [n for n in range(num_nodes) if not (folder / f"node{n}").exists()]:
        if time.monotonic() >= deadline:
            print(f"megatron-hpc: node {node_rank} published its compile cache; not yet published: node(s) "
                  f"{_ranges(missing)}; the last node to publish records the compile fingerprint", flush=True)
            return None
        time.sleep(2.0)
    path = fingerprint.record(Path(fp.cache_root), dataclasses.asdict(fp), run_dir=str(run_dir),
                              job_id=attempt["job_id"])
    print(f"megatron-hpc: recorded compile fingerprint {fp.sha256[:12]} in {path.parent}", flush=True)
    return path


def _ranges(nodes: list[int]) -> str:
    """The first nodes and a count: "0, 3, 15" has gaps that "0..15" would hide."""
    shown = ", ".join(map(str, nodes[:8]))
    return shown if len(nodes) <= 8 else f"{shown} and {len(nodes) - 8} more"


VICTIM_WAIT_S = 2.0
"""How long the first node to report, when its workers only raised, lingers, so that the node whose worker was killed
(and caused it) reports too before srun ends the step (launch/step_exit.py)."""


def record_step_exit(run_dir: Path, *, step: int, exit_code: int, node_rank: int) -> int:
    """An in-job step ended on this node: leave the record the driver decides on (launch/in_job.py); no requeue."""
    who = job_attempt()
    # SLURM's name of the node (what scontrol and the driver use), not the host name, which may be qualified.
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    record = node_exit_from_log(run_dir, host=host, node_rank=node_rank, exit_code=exit_code)
    folder = step_folder(run_dir, job_id=str(who["job_id"]), attempt=who["attempt"], step=step)
    first = not read_node_exits(folder)  # a node that reported before this one is what srun is ending the step for
    write_node_exit(folder, record)
    killed = f", a worker killed by signal {record.worker_signal}" if record.worker_signal else ""
    print(f"megatron-hpc: in-job step {step} ended on {record.host} (exit {exit_code}{killed}); the driver on the "
          "job's first node decides what follows", flush=True)
    if exit_code and record.worker_signal is None and first:
        time.sleep(VICTIM_WAIT_S)
    return exit_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_hpc.launch.requeue",
                                     description="Finish, fail or requeue the job after a phase ended on this node.")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--phase", required=True, choices=("compile", "run", "tune"))
    parser.add_argument("--exit-code", type=int, required=True, help="the phase's exit code on this node")
    parser.add_argument("--node-rank", type=int, default=None,
                        help="this node's rank (node.sh's NODE_RANK; a PyTorchJob pod has no SLURM_NODEID)")
    args = parser.parse_args(argv)
    # Any node's `scontrol requeue` has SLURM send SIGTERM to every process of the job at once, this one included,
    # and a failed run is requeued by whichever node gets there first: node 0 may still be reading the markers
    # when another node's requeue lands. Outlive it (KillWait, then SIGKILL) to record the attempt and say why.
    # (node.sh starts this process with SIGTERM ignored already, which also covers the interpreter's start.)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    step = os.environ.get(IN_JOB_STEP_ENV, "")
    if step.isdigit() and args.phase == "run":
        return record_step_exit(args.run_dir, step=int(step), exit_code=args.exit_code,
                                node_rank=args.node_rank or 0)
    outcome = read_outcome(args.run_dir, phase=args.phase, exit_code=args.exit_code, node_rank=args.node_rank)
    decision = decide(outcome)
    requeued = False
    message = decision.message
    if decision.action == "requeue":
        requeued, why_not = requeue(os.environ["SLURM_JOB_ID"], attempt=outcome.attempt)
        if not requeued:
            message += f"; {why_not}"
    if outcome.node_rank == 0:
        record_attempt(args.run_dir, outcome, decision, requeued=requeued)
    if outcome.phase == "compile" and decision.action == "done":
        record_fingerprint(args.run_dir, node_rank=outcome.node_rank)
    if outcome.phase == "tune" and decision.action == "done":  # its compiled graphs, as a compile phase's
        from megatron_hpc.launch.tune_job import record_candidate_fingerprints, tune_compiles

        if tune_compiles(args.run_dir) and (first := record_fingerprint(args.run_dir, node_rank=outcome.node_rank)):
            record_candidate_fingerprints(args.run_dir, first=first)
    if outcome.phase == "tune" and decision.action == "done" and outcome.node_rank == 0:
        from megatron_hpc.launch.tune_job import finish_tune_run  # the fit and tune.json, once per job

        try:
            print(finish_tune_run(args.run_dir), flush=True)
        except MegatronHpcError as exc:
            print(f"megatron-hpc: error: {exc}", file=sys.stderr, flush=True)
            return 1
    # A stopped run that is not requeued is the phase's reason for failing: say it as an error, which
    # `submit` quotes. A plain failure is explained by the trainer's own output, so stay quieter.
    prefix = "megatron-hpc: error: " if decision.action == "fail" and outcome.stopped else "megatron-hpc: "
    print(prefix + message, file=sys.stderr if decision.action == "fail" else sys.stdout, flush=True)
    if decision.action == "done" or requeued:
        return 0
    return outcome.exit_code or 1


if __name__ == "__main__":
    sys.exit(main())
