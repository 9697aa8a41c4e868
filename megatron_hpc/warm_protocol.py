"""Warm workers for in-job restarts: what the warm process (warm_server.py) and its client (launch/warm_client.py)
share. No torch: the client, the watchdog and `debug` import this.

With hot spares the in-job driver (launch/in_job.py) starts one warm process per node of the allocation, once,
as its own SLURM step. It imports torch and the trainer once and waits on a Unix socket in a node-local folder
named by job and node (`$TMPDIR/megatron-hpc-warm.<job>.<node>/sock`; several SLURM nodes may share one machine,
as on the test cluster). Each worker step's node.sh runs the client instead of torchrun: it sends one request
(the worker CLI's argv, its cwd and CPU affinity, one environment per local rank, as torchrun would give them) with
its stdout and stderr descriptors (SCM_RIGHTS), and the warm process forks the workers. Then the messages are
one JSON object per line:

    server -> client  {"hello": 123}                    on accepting (the client's fds go only to a live server)
    client -> server  {"argv": [...], "cwd": "...", "affinity": [...], "envs": [{...}, ...]}   (+ 2 fds)
    server -> client  {"started": [{"local_rank": 0, "pid": 123}, ...]}
    client -> server  {"signal": 12}                    a signal node.sh's step got, for the workers
    server -> client  {"exit": {"local_rank": 0, "pid": 123, "code": 0, "signal": null, "first": true}}
    server -> client  {"error": "..."}                  the request was refused (the client falls back)

The warm process records each worker it forked as `worker-<pid>.json` in its folder, for the watchdog and `debug`
(launch/stack_dump.py), which find torchrun's workers by their command line and environment in /proc: a forked
worker keeps the warm process's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SOCKET_NAME = "sock"
PID_NAME = "server.pid"
"""Written as the warm process starts (before its imports): a client finding it alive waits for the socket."""
REFUSED_NAME = "refused"
"""Left by a warm process that will not serve (why, one line): its clients start the workers cold at once."""
REGISTRY_GLOB = "worker-*.json"
KILL_GRACE_S = 30.0
"""After a step's first failed worker on a node, how long the others have after SIGTERM before SIGKILL (torchrun's
close timeout)."""
MAX_SOCKET_PATH = 107
"""sun_path holds 108 bytes with the terminating NUL (unix(7))."""
WARM_STEP_NAME = "megatron-hpc-warm"
"""The warm processes' SLURM step: `debug` never takes it for the worker step."""


def warm_folder(environ: Mapping[str, str]) -> Path | None:
    """The node-local folder of this job's warm process on this node; None outside a SLURM job step."""
    job, node = environ.get("SLURM_JOB_ID"), environ.get("SLURMD_NODENAME")
    if not job or not node:
        return None
    return Path(environ.get("TMPDIR") or "/tmp") / f"megatron-hpc-warm.{job}.{node}"


def socket_problem(path: Path) -> str | None:
    """Why a Unix socket cannot live at `path` (one line with the fix), or None."""
    size = len(os.fsencode(str(path)))
    if size > MAX_SOCKET_PATH:
        return (f"the socket path {path} is {size} bytes, over the {MAX_SOCKET_PATH} a Unix socket allows; set TMPDIR "
                "to a shorter node-local folder")
    return None


def worker_envs(base: Mapping[str, str], *, nproc_per_node: int, node_rank: int, nnodes: int, master_addr: str,
                master_port: int) -> list[dict[str, str]]:
    """One environment per local rank: `base` (node.sh's) plus what torchrun's agent gives its workers
    (torch/distributed/elastic/agent/server/local_elastic_agent.py, _start_workers; torch/distributed/run.py sets
    OMP_NUM_THREADS=1 for several workers unless set). No agent hosts a store here: rank 0's init_process_group
    does, so TORCHELASTIC_USE_AGENT_STORE is False."""
    world = nnodes * nproc_per_node
    envs = []
    for local_rank in range(nproc_per_node):
        rank = node_rank * nproc_per_node + local_rank
        env = dict(base)
        if "OMP_NUM_THREADS" not in env and nproc_per_node > 1:
            env["OMP_NUM_THREADS"] = "1"
        env.update({
            "RANK": str(rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": str(node_rank), "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc_per_node), "WORLD_SIZE": str(world),
            "GROUP_WORLD_SIZE": str(nnodes), "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        })
        envs.append(env)
    return envs


def encode(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


class LineReader:
    """Splits what a stream socket delivers into the JSON messages, one per line."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, data: bytes) -> list[dict]:
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]


# ------------------------------------------------------------------------------------- the worker registry


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmWorker:
    rank: int
    pid: int
    server_pid: int
    run_dir: str
    """Resolved: the worker CLI's --run-dir against its cwd."""


def write_registry(folder: Path, worker: WarmWorker) -> None:
    tmp = folder / f".worker-{worker.pid}.json"
    tmp.write_text(json.dumps({"rank": worker.rank, "pid": worker.pid, "server_pid": worker.server_pid,
                               "run_dir": worker.run_dir}))
    tmp.rename(folder / f"worker-{worker.pid}.json")


def remove_registry(folder: Path, pid: int) -> None:
    (folder / f"worker-{pid}.json").unlink(missing_ok=True)


def _parent_pid(pid: int, proc_root: Path) -> int | None:
    """The parent of a live process; None when it is gone or a zombie (dead, its exit status not yet read by the
    warm process, which a loaded machine can leave for a while: nothing there to dump or wait for)."""
    try:
        # The command name (field 2) may hold spaces and parentheses: fields after the last ")".
        state, parent = (proc_root / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        return None if state == "Z" else int(parent)
    except (OSError, IndexError, ValueError):
        return None


def registered_workers(folder: Path | None, *, run_dir: Path, proc_root: Path = Path("/proc")) -> list[WarmWorker]:
    """The warm workers of `run_dir` alive in `folder`: a record whose pid is gone (or a zombie), or now another
    process's (not the warm process's child), is left out."""
    if folder is None or not folder.is_dir():
        return []
    want = os.path.realpath(run_dir)
    found = []
    for path in sorted(folder.glob(REGISTRY_GLOB)):
        try:
            data = json.loads(path.read_text())
            worker = WarmWorker(rank=int(data["rank"]), pid=int(data["pid"]), server_pid=int(data["server_pid"]),
                                run_dir=str(data["run_dir"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if worker.run_dir == want and _parent_pid(worker.pid, proc_root) == worker.server_pid:
            found.append(worker)
    return found
