"""node.sh's side of warm workers: ask this node's warm process (megatron_hpc/warm_server.py) to fork the step's
workers, pass them this process's stdout and stderr, forward the signals the step gets, and exit as torchrun would.

    python -m megatron_hpc.launch.warm_client --nproc-per-node N --node-rank K --nnodes M --master-addr A \
        --master-port P -- torchrun ... -m megatron_hpc train --run-dir RUN --phase run

The command after `--` is what node.sh runs without warm workers: the workers run its `-m MODULE ARGS...`
(as `python -m` would, in the warm process's fork), and when there is no warm process on this node (none
started, it died, it refused the request) this process says so in one line and becomes that command (exec), so
a step never waits on a warm process that is not there. Messages: megatron_hpc/warm_protocol.py. No torch: a
light Python, about 30 ms.

Exit status as torchrun's: 0 when every worker exited 0, else 1 with each worker that failed by itself (before
the others were ended) named as torchrun's failure summary names it (`exitcode  : -9`), which
launch/step_exit.py reads to tell the node that caused a failure from its victims. When this process is killed
(srun's step teardown), the warm process sees the connection close and kills the workers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import socket
import sys
import time
from pathlib import Path

from megatron_hpc.warm_protocol import (
    PID_NAME,
    SOCKET_NAME,
    LineReader,
    encode,
    socket_problem,
    warm_folder,
    worker_envs,
)

START_WAIT_S = 60.0
"""How long a client waits for a warm process that is still importing (its pid file names a live process)."""
FORWARDED = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def say(text: str) -> None:
    print(f"megatron-hpc: warm workers: {text}", file=sys.stderr, flush=True)


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _server_pid(folder: Path) -> int | None:
    try:
        return int((folder / PID_NAME).read_text().strip())
    except (OSError, ValueError):
        return None


def connect(folder: Path | None, *, wait_s: float = START_WAIT_S) -> tuple[socket.socket | None, str]:
    """A connection to the warm process, or None and why there is none."""
    if folder is None:
        return None, "not in a SLURM job step (SLURM_JOB_ID, SLURMD_NODENAME unset)"
    path = folder / SOCKET_NAME
    problem = socket_problem(path)
    if problem:
        return None, problem
    deadline = time.monotonic() + wait_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            return sock, ""
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
        pid = _server_pid(folder)
        if not _alive(pid):
            return None, f"no warm process at {path}"
        if time.monotonic() >= deadline:
            return None, f"the warm process (pid {pid}) was not ready after {wait_s:.0f} s"
        time.sleep(0.05)


def worker_argv(command: list[str]) -> list[str]:
    """The workers' `-m MODULE ARGS...`: torchrun's, from its first `-m` on (`-m megatron_hpc train ...`)."""
    if "-m" not in command[:-1]:
        raise ValueError(f"no `-m MODULE` in the worker command {shlex.join(command)}")
    return command[command.index("-m"):]


def fall_back(command: list[str], why: str) -> int:
    """Become node.sh's torchrun command. Python ignores SIGPIPE, and an exec keeps what is ignored: undone."""
    say(f"{why} on {os.environ.get('SLURMD_NODENAME') or socket.gethostname()}; starting the workers with torchrun")
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        say(f"cannot run {command[0]}: {exc}")
    return 127


def request(sock: socket.socket, message: dict) -> None:
    """The request with this process's stdout and stderr: the workers write where torchrun's would."""
    data = encode(message)
    sent = socket.send_fds(sock, [data], [sys.stdout.fileno(), sys.stderr.fileno()])
    if sent < len(data):
        sock.sendall(data[sent:])


class Session:
    """One request's life on this side: the workers' exits, the signals passed on."""

    def __init__(self, sock: socket.socket, nproc: int):
        self.sock, self.nproc = sock, nproc
        self.reader = LineReader()
        self.exits: list[dict] = []

    def forward(self, signum: int, frame: object) -> None:
        with contextlib.suppress(OSError):  # the warm process is gone; wait() reports it
            self.sock.sendall(encode({"signal": signum}))

    def messages(self) -> list[dict] | None:
        """The next messages; None when the warm process closed the connection."""
        data = self.sock.recv(1 << 16)
        return self.reader.feed(data) if data else None

    def started(self) -> tuple[list[dict] | None, str]:
        while True:
            messages = self.messages()
            if messages is None:
                return None, "the warm process closed the connection before starting the workers"
            for i, message in enumerate(messages):
                if "error" in message:
                    return None, f"the warm process refused the request: {message['error']}"
                if "started" in message:
                    # Quick workers' exits may come in the same read.
                    self.exits += [m["exit"] for m in messages[i + 1:] if "exit" in m]
                    return list(message["started"]), ""

    def wait(self) -> int:
        while len(self.exits) < self.nproc:
            messages = self.messages()
            if messages is None:
                say(f"the warm process died with {self.nproc - len(self.exits)} worker(s) running (they die with "
                    "it); this step fails and the next one starts its workers with torchrun")
                return 1
            self.exits += [m["exit"] for m in messages if "exit" in m]
        failed = [e for e in self.exits if e["code"] != 0]
        for e in (e for e in failed if e.get("first")):
            code = int(e["code"])
            name = f" ({signal.Signals(-code).name})" if code < 0 and -code in signal.valid_signals() else ""
            say(f"local rank {e['local_rank']} (pid {e['pid']}) failed: exitcode  : {code}{name}")
        return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_hpc.launch.warm_client")
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then node.sh's torchrun command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give node.sh's torchrun command after --")
    sock, why = connect(warm_folder(os.environ))
    if sock is None:
        return fall_back(command, why)
    envs = worker_envs(os.environ, nproc_per_node=args.nproc_per_node, node_rank=args.node_rank, nnodes=args.nnodes,
                       master_addr=args.master_addr, master_port=args.master_port)
    session = Session(sock, args.nproc_per_node)
    try:
        request(sock, {"argv": worker_argv(command), "cwd": os.getcwd(),
                       "affinity": sorted(os.sched_getaffinity(0)), "envs": envs})
        started, why = session.started()
    except OSError as exc:
        started, why = None, f"the warm process failed the request: {exc}"
    if started is None:
        sock.close()
        return fall_back(command, why)
    for sig in FORWARDED:  # only now: before, an exec to torchrun must keep node.sh's ignored USR2
        signal.signal(sig, session.forward)
    return session.wait()


if __name__ == "__main__":
    sys.exit(main())
