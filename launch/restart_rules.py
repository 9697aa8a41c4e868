"""The in-job restart's decisions, pure: which nodes a step runs on, why a step failed, and what comes next.

The driver (launch/in_job.py) gathers the facts at its edges (SLURM's view of the allocation and of node
states, the nodes' exit records, hang reports, stragglers, the trainer's markers) into a StepEnd; `decide`
turns them into the next action. Nothing here reads a file, a clock or a process.

Why a step failed, in order of certainty:
- requested: the user asked (`megatron-hpc restart RUN --exclude NODE`) and the workers stopped and saved;
- node_lost: SLURM says a node of the step is unusable (DOWN, DRAIN, FAIL, NOT_RESPONDING), or it has left
  the allocation (with --no-kill SLURM drops a failed node from the job's node list);
- hang: a node watchdog tore the step down; the suspect nodes its `<run>/hangs/*.json` names are left out (none when
  it names none: the watchdog's own kill of its node's workers blames nobody);
- rank_failed: a worker was killed by a signal (its node is the suspect), else the node that failed first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from megatron_hpc.launch.step_exit import NodeExit

Reason = Literal["node_lost", "rank_failed", "hang", "requested"]
Action = Literal["done", "restart", "requeue", "stopped", "fail"]
UNUSABLE_STATES = frozenset({"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING",
                             "NO_RESPOND", "POWER_DOWN", "POWERED_DOWN", "REBOOT"})
"""Node state words (`scontrol show node -o`, State=IDLE+DRAIN, ALLOCATED*) that keep a node out of a step."""


def only_not_responding(state: str) -> bool:
    """Whether a State= value says no more than that slurmd did not answer the controller's last ping (a trailing
    *, NOT_RESPONDING): a node busy tearing a step down, under load, may say so for seconds and answer again."""
    words = set(state.upper().rstrip("*").replace("+", " ").split())
    return (state.endswith("*") or bool(words & {"NOT_RESPONDING", "NO_RESPOND"})) and \
        not words & (UNUSABLE_STATES - {"NOT_RESPONDING", "NO_RESPOND"})


def node_unusable(state: str) -> bool:
    """Whether a State= value of `scontrol show node` keeps the node out (a trailing * means not responding)."""
    if state.endswith("*"):
        return True
    return any(word in UNUSABLE_STATES for word in state.upper().replace("+", " ").split())


@dataclass(frozen=True, kw_only=True, slots=True)
class StepEnd:
    """What the driver knows once a step's srun has returned."""

    step: int
    nodes: tuple[str, ...]
    exit_code: int
    """srun's exit code (0 when every node's task exited 0)."""
    started_at: float
    ended_at: float
    allocation: tuple[str, ...]
    """The job's nodes as SLURM sees them now (a failed node leaves the list under --no-kill)."""
    unusable: frozenset[str] = frozenset()
    not_responding: frozenset[str] = frozenset()
    """The unusable nodes that were only not responding (only_not_responding) as the step ended."""
    exits: tuple[NodeExit, ...] = ()
    """The nodes' exit records of this step, earliest first."""
    hang_suspects: tuple[str, ...] = ()
    """suspect_nodes of the hang reports written during this step."""
    hang_detected_at: float | None = None
    stopped: bool = False
    """The trainer saved and stopped (stopped.json of this step)."""
    fatal: bool = False
    """The trainer failed on an error a retry cannot fix (fatal.json of this step)."""
    requested: tuple[str, ...] | None = None
    """The nodes a restart request excluded, when one was acted on during this step."""
    job_ending: bool = False
    """The driver got SIGTERM during the step: SLURM is ending the job (scancel, preemption, the time limit)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Failure:
    reason: Reason
    nodes_lost: tuple[str, ...]
    failed_at: float


@dataclass(frozen=True, kw_only=True, slots=True)
class DriverState:
    num_nodes: int
    max_restarts: int
    restarts_done: int = 0
    excluded: frozenset[str] = frozenset()
    """Nodes taken out of this job attempt so far (lost, suspects, user requests, stragglers)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Next:
    action: Action
    message: str
    failure: Failure | None = None
    excluded: frozenset[str] = field(default_factory=frozenset)
    """The exclusions after this step (state.excluded plus what this step lost)."""


def node_names(hosts: Iterable[str], allocation: Iterable[str]) -> tuple[str, ...]:
    """Host names (heartbeats, hang reports and stragglers.json carry gethostname()) as SLURM's node names: a
    qualified `gpu-7.cluster.local` is the allocation's `gpu-7`."""
    held = set(allocation)
    return tuple(dict.fromkeys(h if h in held or h.split(".")[0] not in held else h.split(".")[0] for h in hosts))


def healthy_nodes(allocation: Iterable[str], *, unusable: Iterable[str], excluded: Iterable[str]) -> tuple[str, ...]:
    """The allocation's nodes that may run a step, in allocation order."""
    out = set(unusable) | set(excluded)
    return tuple(n for n in allocation if n not in out)


def step_nodes(healthy: tuple[str, ...], *, num_nodes: int, previous: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The next step's nodes: the previous step's survivors first (their order kept), spares filling in."""
    survivors = [n for n in previous if n in healthy]
    spares = [n for n in healthy if n not in survivors]
    chosen = (survivors + spares)[:num_nodes]
    return tuple(chosen) if len(chosen) == num_nodes else ()


def stragglers_to_exclude(healthy: tuple[str, ...], stragglers: Iterable[str], *, num_nodes: int) -> tuple[str, ...]:
    """The stragglers (worst first) to leave out, as many as keep at least num_nodes healthy nodes."""
    room = len(healthy) - num_nodes
    named = [s for s in dict.fromkeys(stragglers) if s in healthy]
    return tuple(named[:max(room, 0)])


def classify(end: StepEnd) -> Failure:
    """Why a step that did not finish failed, and which nodes to leave out of the next one."""
    if end.requested is not None:
        return Failure(reason="requested", nodes_lost=end.requested, failed_at=end.ended_at)
    hung = bool(end.hang_suspects) or end.hang_detected_at is not None
    reported = {e.host for e in end.exits}
    # A node that did not answer one ping while the step was torn down (its slurmd busy under load) is not lost when
    # firmer evidence says what happened: its own exit record (it was up to write it) or a watchdog's hang report.
    # Gone from the job, or DOWN/DRAIN, it is lost.
    lost = tuple(n for n in end.nodes if n not in end.allocation or
                 (n in end.unusable and not (n in end.not_responding and (hung or n in reported))))
    first_exit = min((e.time for e in end.exits if e.exit_code), default=end.ended_at)
    if lost:
        return Failure(reason="node_lost", nodes_lost=lost, failed_at=min(first_exit, end.ended_at))
    if hung:
        # A watchdog tore the step down: its SIGKILL reads as a worker killed by a signal on its own node, which
        # is no evidence (every node's watchdog sees the hang; the first to fire is chance). Only suspects count.
        suspects = tuple(n for n in dict.fromkeys(end.hang_suspects) if n in end.nodes)
        at = end.hang_detected_at if end.hang_detected_at is not None else first_exit
        return Failure(reason="hang", nodes_lost=suspects, failed_at=at)
    signalled = tuple(dict.fromkeys(e.host for e in end.exits if e.worker_signal))
    failed = [e.host for e in end.exits if e.exit_code]
    return Failure(reason="rank_failed", nodes_lost=signalled or tuple(failed[:1]), failed_at=first_exit)


def decide(end: StepEnd, state: DriverState) -> Next:
    """What follows a step: done, restart in the job, stopped (the trainer saved on SLURM's signal: requeue as
    today), requeue (no room to restart here) or fail (a retry would fail the same way)."""
    if end.stopped and end.requested is None:
        return Next(action="stopped", message="the workers stopped and saved on SLURM's signal",
                    excluded=state.excluded)
    if end.exit_code == 0 and not end.stopped:  # a restart asked for as the last step ended comes too late
        return Next(action="done", message="run phase finished", excluded=state.excluded)
    if end.fatal:
        return Next(action="fail", message="the trainer failed on an error a restart cannot fix (fatal.json)",
                    excluded=state.excluded)
    failure = classify(end)
    excluded = state.excluded | set(failure.nodes_lost)
    what = f"step {end.step} on {','.join(end.nodes)}: {failure.reason.replace('_', ' ')}" + (
        f" ({','.join(failure.nodes_lost)})" if failure.nodes_lost else "")
    healthy = healthy_nodes(end.allocation, unusable=end.unusable, excluded=excluded)
    if end.job_ending:  # a step started now would be killed with the job; requeue.requeue leaves an ended job alone
        return Next(action="requeue", failure=failure, excluded=excluded,
                    message=f"{what}; the job got SIGTERM (cancelled, preempted or at its time limit): not restarted "
                            "in it")
    if state.restarts_done >= state.max_restarts:
        return Next(action="requeue", failure=failure, excluded=excluded,
                    message=f"{what}; launch.max_in_job_restarts={state.max_restarts} restarts done in this job: "
                            "requeueing instead (raise launch.max_in_job_restarts to restart in the job longer)")
    if len(healthy) < state.num_nodes:
        return Next(action="requeue", failure=failure, excluded=excluded,
                    message=f"{what}; {len(healthy)} healthy node(s) left in the allocation, {state.num_nodes} "
                            "needed: requeueing instead (raise launch.spare_nodes for more spares)")
    return Next(action="restart", failure=failure, excluded=excluded,
                message=f"{what}; restarting in the job (restart {state.restarts_done + 1} of {state.max_restarts})")
