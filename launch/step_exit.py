"""How each node's part of an in-job step ended: the record node.sh leaves for the in-job driver.

With hot spares (launch/in_job.py) the driver, not the nodes, decides what follows a failed step, and it must
know which node failed first and how. After torchrun has exited, node.sh runs `python -m
megatron_hpc.launch.requeue`, which on an in-job step writes one NodeExit per node under
`<run>/step-exits/<job>.<attempt>.<step>/<host>.json` instead of requeueing. A worker killed by a signal
(SIGKILL by the kernel's OOM killer or a person, SIGSEGV) names its node: torchrun prints the worker's exit as
`exitcode  : -9` in its failure summary, which this node's log holds. A node whose workers only raised (a
peer's socket closed under a collective) is a victim, not the cause; it reports, then lingers a moment so the
node that caused it can report too before srun kills the step (launch/requeue.py).

No torch: this runs on every node after the workers are gone.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_hpc.run_folder import STEP_EXITS_DIR, node_log, write_json

IN_JOB_STEP_ENV = "MEGATRON_HPC_IN_JOB_STEP"
"""Set by the in-job driver on its srun: the step's number in this job attempt (0, 1, ...). node.sh then takes
the rendezvous from the step, and requeue.py records the node's exit instead of requeueing."""
_WORKER_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")
_PHASE_START = "megatron-hpc: run phase, node "
"""The first line node.sh writes to its log for every attempt and step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeExit:
    host: str
    node_rank: int
    """The node's rank in the step (SLURM_NODEID inside a step counts from the step's first node)."""
    exit_code: int
    """torchrun's exit code on this node (node.sh's STATUS)."""
    time: float
    worker_signal: int | None = None
    """The signal that killed one of this node's workers, from torchrun's failure summary; None when none did."""

    @classmethod
    def from_json(cls, data: dict) -> NodeExit | None:
        try:
            return cls(host=str(data["host"]), node_rank=int(data["node_rank"]), exit_code=int(data["exit_code"]),
                       time=float(data["time"]), worker_signal=data.get("worker_signal"))
        except (KeyError, TypeError, ValueError):
            return None


def step_folder(run_dir: Path, *, job_id: str, attempt: int, step: int) -> Path:
    return run_dir / STEP_EXITS_DIR / f"{job_id}.{attempt}.{step}"


def write_node_exit(folder: Path, record: NodeExit) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return write_json(folder / f"{record.host}.json", asdict(record), indent=None)


def read_node_exits(folder: Path) -> tuple[NodeExit, ...]:
    """The records of one step, earliest first; an unreadable one is left out (its node was killed writing it)."""
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = NodeExit.from_json(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
        if record is not None:
            found.append(record)
    return tuple(sorted(found, key=lambda r: r.time))


def worker_signal(log_text: str) -> int | None:
    """The first signal that killed a worker in the last step of a node log, from torchrun's failure summary
    (`exitcode  : -9 (pid: ...)`); None when every worker exited by itself."""
    last = log_text.rfind(_PHASE_START)
    for match in _WORKER_EXIT.finditer(log_text[max(last, 0):]):
        code = int(match.group(1))
        if code < 0:
            return -code
    return None


def node_exit_from_log(run_dir: Path, *, host: str, node_rank: int, exit_code: int) -> NodeExit:
    try:
        text = node_log(run_dir, "run", node_rank).read_text(errors="replace")
    except OSError:
        text = ""
    return NodeExit(host=host, node_rank=node_rank, exit_code=exit_code, time=time.time(),
                    worker_signal=worker_signal(text) if exit_code else None)
