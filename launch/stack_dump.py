"""One node's share of `megatron-hpc debug`: the Python stacks of this run's trainer workers here.

Run on every node of a running job (`srun --overlap`), or directly for a local run:

    python -m megatron_hpc.launch.stack_dump --run-dir RUN [--method auto|py-spy|signal] [--timeout S]

Workers are found in /proc by their command line (`-m megatron_hpc train --run-dir RUN`) and by
the variables torchrun gives each worker (RANK, GROUP_RANK; the torchrun agent has neither). Each
is dumped with `py-spy dump` when py-spy is on PATH (it reads the process from outside, so it works
even when the interpreter is stuck), else by SIGUSR1, which the trainer's faulthandler answers
(megatron_hpc/debug_stacks.py). Prints one JSON object per worker on stdout. No torch import.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_hpc.debug_stacks import STACK_SIGNAL, stacks_file
from megatron_hpc.warm_protocol import registered_workers, warm_folder


@dataclass(frozen=True, slots=True)
class Worker:
    rank: int
    pid: int


@dataclass(slots=True)
class RankStacks:
    rank: int
    pid: int
    host: str
    method: str
    stacks: str
    error: str | None = None


def find_workers(run_dir: Path, proc_root: Path = Path("/proc"), *, node_name: str | None = None,
                 warm: Path | None = None) -> list[Worker]:
    """This machine's trainer workers of the run, by rank (lowest pid first when a rank repeats).

    With `node_name` (SLURMD_NODENAME of this step), a worker whose own SLURMD_NODENAME differs is left out: it
    belongs to another node's slurmd, which happens when several SLURM nodes share one machine (the test cluster).
    Workers a warm process forked (megatron_hpc/warm_server.py) keep its command line and environment: they are
    read from its registry in `warm` (default: this job step's warm folder).
    """
    want = os.path.realpath(run_dir)
    found: dict[int, int] = {}
    for forked in registered_workers(warm_folder(os.environ) if warm is None else warm, run_dir=run_dir,
                                     proc_root=proc_root):
        found[forked.rank] = min(forked.pid, found.get(forked.rank, forked.pid))
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
            if "megatron_hpc" not in argv or "train" not in argv or "--run-dir" not in argv:
                continue
            if any(a.endswith(("torchrun", "torch.distributed.run")) for a in argv):
                continue
            given = argv[argv.index("--run-dir") + 1]
            cwd = os.readlink(entry / "cwd")
            if os.path.realpath(os.path.join(cwd, given)) != want:
                continue
            env = dict(item.split(b"=", 1) for item in (entry / "environ").read_bytes().split(b"\0") if b"=" in item)
        except (OSError, IndexError, ValueError):
            continue  # gone, or not ours to read
        theirs = env.get(b"SLURMD_NODENAME")
        if node_name is not None and theirs is not None and theirs.decode(errors="replace") != node_name:
            continue
        if b"RANK" in env and b"GROUP_RANK" in env:
            rank, pid = int(env[b"RANK"]), int(entry.name)
            found[rank] = min(pid, found.get(rank, pid))
    return [Worker(rank=r, pid=p) for r, p in sorted(found.items())]


def dump_with_py_spy(worker: Worker, *, timeout_s: float, nonblocking: bool = False) -> tuple[str, str | None]:
    """py-spy's dump; `nonblocking` reads without suspending the process, which py-spy cannot do to a stopped one
    (launch/watchdog.py)."""
    extra = ["--nonblocking"] if nonblocking else []
    try:
        proc = subprocess.run(["py-spy", "dump", *extra, "--pid", str(worker.pid)], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return "", f"py-spy dump did not answer within {timeout_s:.0f} s"
    if proc.returncode != 0:
        return proc.stdout, (proc.stderr.strip() or f"py-spy exited with {proc.returncode}")[:500]
    return proc.stdout, None


def dump_with_signal(worker: Worker, run_dir: Path, *, timeout_s: float) -> tuple[str, str | None]:
    """SIGUSR1, then what faulthandler appended to the rank's stacks file."""
    path = stacks_file(run_dir, worker.rank)
    before = path.stat().st_size if path.exists() else 0
    try:
        os.kill(worker.pid, STACK_SIGNAL)
    except OSError as exc:
        return "", f"could not signal pid {worker.pid}: {exc}"
    deadline = time.monotonic() + timeout_s
    size, stable_since = before, None
    while time.monotonic() < deadline:
        now = path.stat().st_size if path.exists() else 0
        if now > before and now == size:
            if stable_since is not None and time.monotonic() - stable_since >= 0.3:
                break
            stable_since = stable_since or time.monotonic()
        else:
            stable_since = None
        size = now
        time.sleep(0.05)
    if size <= before:
        return "", (f"rank {worker.rank} wrote no stacks to {path} within {timeout_s:.0f} s after SIGUSR1 "
                    "(started before the handler was registered, or not a megatron-hpc trainer); install "
                    "py-spy on the nodes")
    with path.open("rb") as fh:
        fh.seek(before)
        return fh.read(size - before).decode(errors="replace"), None


def choose_method(method: str) -> str:
    if method == "auto":
        return "py-spy" if shutil.which("py-spy") else "signal"
    return method


def collect(run_dir: Path, *, method: str = "auto", timeout_s: float = 20.0) -> list[RankStacks]:
    chosen = choose_method(method)
    host = socket.gethostname()
    workers = find_workers(run_dir, node_name=os.environ.get("SLURMD_NODENAME"))

    def one(worker: Worker) -> RankStacks:
        if chosen == "py-spy":
            text, error = dump_with_py_spy(worker, timeout_s=timeout_s)
        else:
            text, error = dump_with_signal(worker, run_dir, timeout_s=timeout_s)
        return RankStacks(rank=worker.rank, pid=worker.pid, host=host, method=chosen, stacks=text, error=error)

    if not workers:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(workers))) as pool:
        return list(pool.map(one, workers))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_hpc.launch.stack_dump")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--method", choices=("auto", "py-spy", "signal"), default="auto")
    parser.add_argument("--timeout", type=float, default=20.0)
    args = parser.parse_args(argv)
    if args.method == "py-spy" and shutil.which("py-spy") is None:
        print(json.dumps({"host": socket.gethostname(), "error": "py-spy is not on PATH on this node"}), flush=True)
        return 1
    results = collect(args.run_dir, method=args.method, timeout_s=args.timeout)
    if not results:
        print(json.dumps({"host": socket.gethostname(), "error": "no trainer worker of this run on this node"}),
              flush=True)
    for item in results:
        print(json.dumps(asdict(item)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
