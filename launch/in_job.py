"""The in-job driver: with hot spares, the run phase's batch script runs this instead of one `srun node.sh run`.

The job holds N + K nodes (`launch.spare_nodes: K`, sbatch --no-kill, so a lost node does not end it). The
driver starts the workers as a step on N healthy nodes; when the step fails it starts another on N healthy
nodes (the failed ones left out, spares filling in) and the trainer resumes from the newest complete
checkpoint, without the job leaving the allocation. launch/restart_rules.py decides; this module gathers the
facts and runs the commands:

- the allocation from `scontrol show job` (its live NodeList: SLURM drops a failed node under --no-kill) and
  node states from `scontrol show node`;
- each node's exit from `<run>/step-exits/` (launch/step_exit.py), hang reports from `<run>/hangs/*.json`,
  stragglers from `<run>/stragglers.json`, the trainer's stopped.json and fatal.json;
- a restart request (`megatron-hpc restart RUN --exclude NODE`, `<run>/restart-request.json`): the driver
  leaves the stop request the trainer already heeds (run_markers.py), the workers save at the next step and
  exit, and the next step runs without those nodes.

Each restart appends a line to `<run>/restarts.jsonl`, and a second one once the new step logged its first
iteration (`status` reports the cost). With fewer than N healthy nodes, or launch.max_in_job_restarts reached,
today's requeue takes over (launch/requeue.py), as it does for a step stopped by SLURM's time signal.
No torch: this runs in the batch script on the job's first node.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_hpc.launch import requeue as requeue_mod
from megatron_hpc.launch.restart_log import RestartRecord, read_stragglers
from megatron_hpc.launch.restart_request import RestartRequest
from megatron_hpc.launch.restart_rules import (
    DriverState,
    Next,
    StepEnd,
    decide,
    healthy_nodes,
    node_names,
    node_unusable,
    only_not_responding,
    step_nodes,
    stragglers_to_exclude,
)
from megatron_hpc.launch.run_status import last_checkpoint
from megatron_hpc.launch.slurm_nodes import allocation_nodes, hostnames, node_states, unusable_nodes
from megatron_hpc.launch.step_exit import IN_JOB_STEP_ENV, read_node_exits, step_folder

from megatron_hpc.run_folder import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    HANGS_DIR,
    METRICS_FILE,
    RESTART_REQUEST_FILE,
    RESTARTS_FILE,
    STOP_REQUEST_FILE,
    append_jsonl,
    read_json,
)
from megatron_hpc.run_markers import FATAL_FILE, STOPPED_FILE, job_attempt, read_marker, read_stopped, write_marker
from megatron_hpc.warm_protocol import WARM_STEP_NAME

POLL_S = 0.5
SCONTROL_TRIES = 3
SCONTROL_RETRY_S = 5.0
"""scontrol answering no node list (a busy controller, a timeout) is asked again this often, this far apart."""
WARM_STOP_S = 10.0


# --------------------------------------------------------------------------------------- run-folder edges


@dataclass(frozen=True, kw_only=True, slots=True)
class Seen:
    """What the run folder held as a step started. A hang report or marker is the step's when it is not one of
    these: their times are the writing node's clock, which may run ahead of the driver's by more than the seconds
    between one step's end and the next one's start (an old record would then read as the new step's)."""

    hang_reports: frozenset[str]
    stopped: bytes | None
    fatal: bytes | None

    @classmethod
    def now(cls, run_dir: Path) -> Seen:
        return cls(hang_reports=frozenset(p.name for p in (run_dir / HANGS_DIR).glob("*.json")),
                   stopped=_read_bytes(run_dir / STOPPED_FILE), fatal=_read_bytes(run_dir / FATAL_FILE))


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def hang_reports(run_dir: Path, *, seen: frozenset[str]) -> tuple[tuple[str, ...], float | None]:
    """suspect_nodes of the hang reports not in `seen` (written during the step), and the earliest detection
    time."""
    suspects: list[str] = []
    first = None
    for path in sorted((run_dir / HANGS_DIR).glob("*.json")):
        if path.name in seen:
            continue
        try:
            data = read_json(path)
            at = float(data["detected_at"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        suspects += [str(n) for n in data.get("suspect_nodes") or []]
        first = at if first is None else min(first, at)
    return tuple(dict.fromkeys(suspects)), first


def stragglers(run_dir: Path) -> tuple[str, ...]:
    """The nodes stragglers.json names, slowest first; () when there is none."""
    ranked = sorted(read_stragglers(run_dir), key=lambda n: -float(n.get("ratio") or 0.0))
    return tuple(str(n["node"]) for n in ranked)


def marker_new(run_dir: Path, name: str, before: bytes | None) -> bool:
    """This attempt's marker, written during the step that started when it read `before` (steps share an
    attempt)."""
    now = _read_bytes(run_dir / name)
    return now is not None and now != before and read_marker(run_dir, name) is not None


def resume_point(run_dir: Path) -> str:
    """Where the next step's trainer resumes, for the driver's line (it never restarts from 0 silently)."""
    try:
        save = (read_json(run_dir / CONFIG_FILE).get("checkpoint") or {}).get("save")
    except (OSError, ValueError, AttributeError):
        save = None
    folder = last_checkpoint(Path(save).expanduser() if save else run_dir / CHECKPOINT_DIR)
    return f"resumes from {folder}" if folder else "no checkpoint yet: starts again from iteration 0"


def _metrics_size(run_dir: Path) -> int:
    try:
        return (run_dir / METRICS_FILE).stat().st_size
    except OSError:
        return 0


def _first_step_logged(run_dir: Path, offset: int) -> bool:
    """Whether metrics.jsonl gained a training row after `offset` (the new step's first logged iteration)."""
    try:
        with (run_dir / METRICS_FILE).open() as fh:
            fh.seek(offset)
            lines = fh.read().splitlines()
    except OSError:
        return False
    for line in lines:
        try:
            if json.loads(line).get("phase") == "run":
                return True
        except (ValueError, AttributeError):
            continue
    return False


# -------------------------------------------------------------------------------------------------- the loop


@dataclass(kw_only=True, slots=True)
class Driver:
    run_dir: Path
    num_nodes: int
    max_restarts: int
    max_requeues: int
    exclude_stragglers: bool
    srun_tail: list[str]
    """srun's own flags and the node command (`--kill-on-bad-exit=1 ... bash node.sh run`)."""
    job_id: str = ""
    attempt: int = 0
    watch_offset: int | None = None
    """metrics.jsonl's size when a restarted step started, until it logs its first iteration."""
    known: tuple[str, ...] = ()
    """The allocation as scontrol last gave it."""
    warm: bool = False
    """launch.warm_restart: one warm process per node (megatron_hpc/warm_server.py) forks each step's workers."""
    warm_proc: subprocess.Popen | None = None
    job_ending: bool = False
    """SIGTERM came: SLURM is ending the job and signals every process of it, this one too (on_term)."""

    def on_term(self, signum: int, frame: object) -> None:
        # Not fatal: the step's nodes save and exit on the same signal, and the attempt must still be recorded once
        # they have (node.sh does the same on each node). Only a flag: the loop is between two calls.
        self.job_ending = True

    def say(self, text: str) -> None:
        print(f"megatron-hpc: in-job: {text}", flush=True)

    def allocation(self) -> tuple[str, ...]:
        """The job's nodes now. A job never holds no node: scontrol answering none is no answer, not every node
        lost; it is asked again, then the last known allocation stands (SLURM's node states still count)."""
        for attempt in range(SCONTROL_TRIES):
            nodes = allocation_nodes(self.job_id)
            if nodes:
                self.known = nodes
                return nodes
            if attempt + 1 < SCONTROL_TRIES:
                time.sleep(SCONTROL_RETRY_S)
        which = "the last known one"
        if not self.known:
            # Before any answer (a controller busy as the job starts), the list the job started with: this
            # script's own SLURM_JOB_NODELIST, expanded without asking the controller. No list at all would read as
            # no healthy node and requeue a job that holds every node it asked for.
            self.known, which = hostnames(os.environ.get("SLURM_JOB_NODELIST", "")), "the job's starting one"
        self.say(f"scontrol gave no node list for job {self.job_id} ({SCONTROL_TRIES} tries); {which} "
                 f"stands: {','.join(self.known) or 'none'}")
        return self.known

    def srun_argv(self, nodes: tuple[str, ...]) -> list[str]:
        n = str(len(nodes))
        return ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}",
                *self.srun_tail]

    def start_warm(self) -> None:
        """The warm processes: one step on every node of the allocation, for the job's life. --overlap shares the
        nodes with the worker steps; --no-kill and no --kill-on-bad-exit keep it on the other nodes when one is
        lost or one warm process fails (that node's steps then start torchrun: node.sh says so). The node command
        is srun_tail's last three words (`bash node.sh run`, launch/scripts.py), here in its warm phase."""
        nodes = self.allocation()
        if not nodes:
            return
        self.warm_proc = subprocess.Popen(self.warm_argv(nodes), stdin=subprocess.DEVNULL)
        self.say(f"warm workers: a warm process on each of {','.join(nodes)} (launch.warm_restart)")

    def warm_argv(self, nodes: tuple[str, ...]) -> list[str]:
        n = str(len(nodes))
        *flags, bash, script, _phase = self.srun_tail
        flags = [f for f in flags if not f.startswith("--kill-on-bad-exit")]
        return ["srun", "--overlap", "--no-kill", f"--job-name={WARM_STEP_NAME}", f"--nodes={n}", f"--ntasks={n}",
                "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}", *flags, bash, script, "warm"]

    def stop_warm(self) -> None:
        """The warm step ends with the job anyway; ended here so that a finished driver leaves nothing running."""
        if self.warm_proc is None or self.warm_proc.poll() is not None:
            return
        self.warm_proc.terminate()
        try:
            self.warm_proc.wait(timeout=WARM_STOP_S)
        except subprocess.TimeoutExpired:
            self.warm_proc.kill()
            self.warm_proc.wait()

    def run_step(self, step: int, nodes: tuple[str, ...]) -> StepEnd:
        started, seen = time.time(), Seen.now(self.run_dir)
        env = {**os.environ, IN_JOB_STEP_ENV: str(step)}
        proc = subprocess.Popen(self.srun_argv(nodes), env=env, stdin=subprocess.DEVNULL)
        requested: tuple[str, ...] | None = None
        while proc.poll() is None:
            requested = requested or self.take_request(step)
            if requested is not None:
                self.keep_stop_request()
            self.watch_first_step(step)
            time.sleep(POLL_S)
        ended = time.time()
        allocation = self.allocation()
        suspects, hang_at = hang_reports(self.run_dir, seen=seen.hang_reports)
        suspects = node_names(suspects, (*allocation, *nodes))
        folder = step_folder(self.run_dir, job_id=self.job_id, attempt=self.attempt, step=step)
        states = node_states(tuple(set(allocation) | set(nodes)))
        return StepEnd(step=step, nodes=nodes, exit_code=proc.returncode, started_at=started, ended_at=ended,
                       allocation=allocation, unusable=frozenset(n for n, s in states.items() if node_unusable(s)),
                       not_responding=frozenset(n for n, s in states.items() if only_not_responding(s)),
                       exits=read_node_exits(folder), hang_suspects=suspects, hang_detected_at=hang_at,
                       stopped=marker_new(self.run_dir, STOPPED_FILE, seen.stopped),
                       fatal=marker_new(self.run_dir, FATAL_FILE, seen.fatal), requested=requested,
                       job_ending=self.job_ending)

    def take_request(self, step: int) -> tuple[str, ...] | None:
        """A restart request for this job: ask the workers to stop (they save first); the nodes to exclude."""
        request = RestartRequest.read(self.run_dir)
        if request is None or request.job_id != self.job_id:
            return None
        (self.run_dir / RESTART_REQUEST_FILE).unlink(missing_ok=True)
        write_marker(self.run_dir, STOP_REQUEST_FILE, {"signal": "restart request"})
        self.say(f"restart requested without {','.join(request.exclude)}: step {step} saves at its next "
                 "iteration and stops")
        return tuple(request.exclude)

    def keep_stop_request(self) -> None:
        """The stop request again when it is gone: node.sh removes an earlier attempt's as it starts, and a request
        taken in the step's first seconds would be lost with it (the trainer never removes one)."""
        if not (self.run_dir / STOP_REQUEST_FILE).exists():
            write_marker(self.run_dir, STOP_REQUEST_FILE, {"signal": "restart request"})

    def watch_first_step(self, step: int) -> None:
        if self.watch_offset is not None and _first_step_logged(self.run_dir, self.watch_offset):
            append_jsonl(self.run_dir / RESTARTS_FILE, {"step": step, "first_step_done_at": time.time(),
                                                       "job_id": self.job_id, "attempt": self.attempt})
            self.watch_offset = None

    def choose(self, state: DriverState, previous: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The next step's nodes, and the stragglers left out for it."""
        allocation = self.allocation()
        healthy = healthy_nodes(allocation, unusable=unusable_nodes(allocation), excluded=state.excluded)
        slow = (stragglers_to_exclude(healthy, node_names(stragglers(self.run_dir), allocation),
                                      num_nodes=self.num_nodes)
                if self.exclude_stragglers and previous else ())
        healthy = tuple(n for n in healthy if n not in slow)
        return step_nodes(healthy, num_nodes=self.num_nodes, previous=previous), slow

    def loop(self) -> int:
        if self.warm:
            self.start_warm()
        try:
            return self.steps()
        finally:
            self.stop_warm()

    def steps(self) -> int:
        state = DriverState(num_nodes=self.num_nodes, max_restarts=self.max_restarts)
        step, nodes, pending = 0, (), None
        while True:
            nodes, slow = self.choose(state, nodes)
            if not nodes:
                return self.finish(Next(action="requeue", message=f"fewer than {self.num_nodes} healthy nodes in "
                                        "the allocation: requeueing"), exit_code=1)
            if slow:
                state = DriverState(num_nodes=state.num_nodes, max_restarts=state.max_restarts,
                                    restarts_done=state.restarts_done, excluded=state.excluded | set(slow))
                self.say(f"leaving out the straggler(s) {','.join(slow)} (launch.exclude_stragglers)")
            if pending is not None:
                record = RestartRecord(**{**pending, "step": step, "nodes": list(nodes),
                                          "new_step_started_at": time.time()})
                append_jsonl(self.run_dir / RESTARTS_FILE, asdict(record))
                self.watch_offset = _metrics_size(self.run_dir)
            self.say(f"step {step} on {','.join(nodes)}")
            end = self.run_step(step, nodes)
            nxt = decide(end, state)
            if nxt.action != "restart":
                return self.finish(nxt, exit_code=end.exit_code)
            failure = nxt.failure
            self.say(f"{nxt.message}; the trainer {resume_point(self.run_dir)}")
            pending = {"reason": failure.reason, "nodes_lost": list(failure.nodes_lost), "failed_at": failure.failed_at,
                       "detected_at": end.ended_at, "job_id": self.job_id, "attempt": self.attempt}
            state = DriverState(num_nodes=state.num_nodes, max_restarts=state.max_restarts,
                                restarts_done=state.restarts_done + 1, excluded=nxt.excluded)
            step += 1

    def finish(self, nxt: Next, *, exit_code: int) -> int:
        """Done, or what today's node task does after a phase: requeue (up to the limit) or fail."""
        if nxt.action != "done":  # requeue.decide says "run phase finished" itself
            self.say(nxt.message)
        stopped = read_stopped(self.run_dir) if nxt.action == "stopped" else None
        # A step that failed must read as a failure to requeue.decide, whatever srun returned.
        code = exit_code if nxt.action in ("done", "stopped") else (exit_code or 1)
        outcome = requeue_mod.Outcome(phase="run", exit_code=code,
                                      node_rank=0, attempt=self.attempt, max_requeues=self.max_requeues,
                                      on_slurm=True, stopped=stopped,
                                      fatal=requeue_mod.read_fatal(self.run_dir) if nxt.action == "fail" else None)
        decision = requeue_mod.decide(outcome)
        requeued, message = False, decision.message
        if decision.action == "requeue":
            # scontrol requeue sends SIGTERM to this batch script: outlive it long enough to record the attempt
            # (SLURM kills what is left after KillWait).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            requeued, why_not = requeue_mod.requeue(self.job_id, attempt=self.attempt)
            message += f"; {why_not}" if not requeued else ""
        requeue_mod.record_attempt(self.run_dir, outcome, decision, requeued=requeued)
        print(f"megatron-hpc: {message}", file=sys.stderr if decision.action == "fail" else sys.stdout, flush=True)
        return 0 if decision.action == "done" or requeued else (outcome.exit_code or 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_hpc.launch.in_job",
                                     description="Run the workers as steps on healthy nodes of the allocation; "
                                                 "restart in the job when a step fails.")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--nodes", type=int, required=True, help="nodes per step (the plan's num_nodes)")
    parser.add_argument("--max-restarts", type=int, required=True, help="launch.max_in_job_restarts")
    parser.add_argument("--max-requeues", type=int, default=requeue_mod.DEFAULT_MAX_REQUEUES)
    parser.add_argument("--exclude-stragglers", action="store_true", help="launch.exclude_stragglers")
    parser.add_argument("--warm", action="store_true", help="launch.warm_restart: warm processes fork the workers")
    parser.add_argument("srun", nargs=argparse.REMAINDER, help="-- then srun's flags and the node command")
    args = parser.parse_args(argv)
    tail = args.srun[1:] if args.srun[:1] == ["--"] else args.srun
    who = job_attempt()
    driver = Driver(run_dir=args.run_dir, num_nodes=args.nodes, max_restarts=args.max_restarts,
                    max_requeues=args.max_requeues, exclude_stragglers=args.exclude_stragglers, srun_tail=tail,
                    warm=args.warm, job_id=str(who["job_id"] or ""), attempt=who["attempt"])
    # SLURM's SIGTERM (scancel, preemption, the time limit) reaches the driver with its step: by default it would die
    # at once, and the attempt would go unrecorded while the step's workers save.
    signal.signal(signal.SIGTERM, driver.on_term)
    driver.say(f"job {driver.job_id} attempt {driver.attempt} on {socket.gethostname()}: steps of {args.nodes} "
               f"node(s), up to {args.max_restarts} restart(s) in the job")
    return driver.loop()


if __name__ == "__main__":
    sys.exit(main())
