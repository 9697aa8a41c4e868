"""node.sh's side of warm workers: ask this node's warm process (megatron_hpc/warm_server.py) to fork the step's
workers, pass them this process's stdout and stderr, forward the signals the step gets, and exit as torchrun would.

    python -m megatron_hpc.launch.warm_client --nproc-per-node N --node-rank K --nnodes M --master-addr A \
        --master-port P -- torchrun ... -m megatron_hpc train --run-dir RUN --phase run

The command after `--` is what node.sh runs without warm workers: the workers run its `-m MODULE ARGS...`
(as `python -m` would, in the warm process's fork). When there is no warm process on this node (none started,
it died, it refused the request) this process says so in one line and starts the workers cold itself
(ColdWorkers), so a step never waits on a warm process that is not there (a job's first step waits for one still
starting). Messages: megatron_hpc/warm_protocol.py. No torch: a light Python, about 30 ms.

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
import subprocess
import sys
import time
from pathlib import Path

from megatron_hpc.launch.process_alive import pid_alive
from megatron_hpc.launch.step_exit import IN_JOB_STEP_ENV

from megatron_hpc.warm_protocol import (
    KILL_GRACE_S,
    PID_NAME,
    REFUSED_NAME,
    SOCKET_NAME,
    LineReader,
    encode,
    socket_problem,
    warm_folder,
    worker_envs,
)

START_WAIT_S = 60.0
"""How long a client waits for a warm process that is still importing (its pid file names a live process)."""
REPLY_WAIT_S = 30.0
"""How long a client waits for the warm process's greeting, then for its reply to the request: its kernel
accepts the connection even when it serves nobody (stopped, stuck), and a step must not hang on it. Above the
warm process's own REQUEST_TIMEOUT_S (10 s), the most another client's request may keep it from answering."""
POLL_S = 0.05
FORWARDED = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
TEARDOWN = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals that end the step (srun's teardown after another node failed, scancel): a worker that exits after one
of them was passed on is a victim of the teardown, never named as failing by itself (torchrun, signalled, prints
no failure summary either), or the driver would blame this node too and leave it out of the next step."""


def say(text: str) -> None:
    print(f"megatron-hpc: warm workers: {text}", file=sys.stderr, flush=True)


def _alive(pid: int | None) -> bool:
    return pid is not None and pid_alive(pid)


def _server_pid(folder: Path) -> int | None:
    try:
        return int((folder / PID_NAME).read_text().strip())
    except (OSError, ValueError):
        return None


def connect(folder: Path | None, *, wait_for_start: bool = False,
            wait_s: float = START_WAIT_S) -> tuple[socket.socket | None, str]:
    """A connection to the warm process, or None and why there is none. One still importing (its pid file names a
    live process) is waited for up to wait_s; with `wait_for_start` also one not started yet."""
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
        try:
            return None, f"the warm process refused to serve: {(folder / REFUSED_NAME).read_text().strip()}"
        except OSError:
            pass
        pid = _server_pid(folder)
        if not _alive(pid) and not wait_for_start:
            return None, f"no warm process at {path}"
        if time.monotonic() >= deadline:
            return None, f"no warm process ready at {path} after {wait_s:.0f} s"
        time.sleep(POLL_S)


def worker_argv(command: list[str]) -> list[str]:
    """The workers' `-m MODULE ARGS...`: torchrun's, from its first `-m` on (`-m megatron_hpc train ...`)."""
    if "-m" not in command[:-1]:
        raise ValueError(f"no `-m MODULE` in the worker command {shlex.join(command)}")
    return command[command.index("-m"):]


def say_cold(why: str) -> None:
    say(f"{why} on {os.environ.get('SLURMD_NODENAME') or socket.gethostname()}; starting the workers cold (new "
        "interpreters, as torchrun would)")


class ColdWorkers:
    """The workers as new interpreters, children of this process, when there is no warm process: torchrun's way of
    starting them, without its agent. Not torchrun itself: its agent waits for every node's agent before starting
    a worker, so a node running it would wait for the warm nodes of the same step until launch.init_timeout_s;
    these workers meet the others in the trainer's init_process_group, like warm ones. srun's step teardown kills
    them with this process (they run in its step)."""

    def __init__(self, argv: list[str], envs: list[dict[str, str]]):
        # Started before the signal handlers below: they inherit node.sh's ignored USR2 (a handler would be reset
        # to the default, which kills, until the trainer installs its own).
        self.procs = [subprocess.Popen([sys.executable, *argv], env=env) for env in envs]
        self.exits: list[dict] = []
        self.torn_down = False

    def forward(self, signum: int, frame: object) -> None:
        self.torn_down = self.torn_down or signum in TEARDOWN
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signum)

    def wait(self) -> int:
        """Like torchrun: after the first failure the others get SIGTERM, KILL_GRACE_S later SIGKILL."""
        running, failed_at = dict(enumerate(self.procs)), None
        while running:
            for local_rank, proc in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                del running[local_rank]
                self.exits.append({"local_rank": local_rank, "pid": proc.pid, "code": code,
                                   "first": failed_at is None and not self.torn_down})
                if code != 0 and failed_at is None:
                    failed_at = time.monotonic()
                    for other in running.values():
                        with contextlib.suppress(ProcessLookupError):
                            other.terminate()
            if failed_at is not None and time.monotonic() - failed_at > KILL_GRACE_S:
                for other in running.values():
                    with contextlib.suppress(ProcessLookupError):
                        other.kill()
            time.sleep(POLL_S)
        return summarize(self.exits)


def summarize(exits: list[dict]) -> int:
    """torchrun's exit status, and each worker that failed by itself named as its failure summary names it."""
    failed = [e for e in exits if e["code"] != 0]
    for e in (e for e in failed if e.get("first")):
        code = int(e["code"])
        name = f" ({signal.Signals(-code).name})" if code < 0 and -code in signal.valid_signals() else ""
        say(f"local rank {e['local_rank']} (pid {e['pid']}) failed: exitcode  : {code}{name}")
    return 1 if failed else 0


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
        self.torn_down = False

    def forward(self, signum: int, frame: object) -> None:
        self.torn_down = self.torn_down or signum in TEARDOWN
        with contextlib.suppress(OSError):  # the warm process is gone; wait() reports it
            self.sock.sendall(encode({"signal": signum}))

    def messages(self) -> list[dict] | None:
        """The next messages; None when the warm process closed the connection."""
        data = self.sock.recv(1 << 16)
        return self.reader.feed(data) if data else None

    def greeted(self) -> None:
        """Returns at the warm process's greeting, or at its end (which started() then reports)."""
        while True:
            messages = self.messages()
            if messages is None or any("hello" in m for m in messages):
                return

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
                    "it); this step fails, and the next one starts its workers cold on this node")
                return 1
            self.exits += [self.as_seen(m["exit"]) for m in messages if "exit" in m]
        return summarize(self.exits)

    def as_seen(self, exit_: dict) -> dict:
        """A worker's exit; not its own failure when the step was being torn down (TEARDOWN)."""
        return {**exit_, "first": False} if self.torn_down else exit_


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
    envs = worker_envs(os.environ, nproc_per_node=args.nproc_per_node, node_rank=args.node_rank, nnodes=args.nnodes,
                       master_addr=args.master_addr, master_port=args.master_port)
    workers = warm_workers(worker_argv(command), envs)
    if isinstance(workers, str):
        say_cold(workers)
        workers = ColdWorkers(worker_argv(command), envs)
    for sig in FORWARDED:  # only now that the workers run (see ColdWorkers)
        signal.signal(sig, workers.forward)
    return workers.wait()


def warm_workers(argv: list[str], envs: list[dict[str, str]]) -> Session | str:
    """The workers forked by this node's warm process, or why there are none. The first step of a job may start
    while the warm process is still starting: it is waited for (a later step finds it ready, or never will)."""
    first_step = os.environ.get(IN_JOB_STEP_ENV) == "0"
    sock, why = connect(warm_folder(os.environ), wait_for_start=first_step)
    if sock is None:
        return why
    session = Session(sock, len(envs))
    sock.settimeout(REPLY_WAIT_S)
    try:
        # Our descriptors go only to a warm process that answers: sent to one that never accepts, they would stay
        # in its socket's queue, and node.sh's tee would never see the end of its input.
        session.greeted()
        request(sock, {"argv": argv, "cwd": os.getcwd(), "affinity": sorted(os.sched_getaffinity(0)), "envs": envs})
        started, why = session.started()
    except TimeoutError:  # closing the connection makes it kill whatever it forks for this request later
        started, why = None, f"the warm process did not answer in {REPLY_WAIT_S:g} s"
    except OSError as exc:
        started, why = None, f"the warm process failed the request: {exc}"
    if started is None:
        sock.close()
        return why
    sock.settimeout(None)  # the workers run as long as they run
    return session


if __name__ == "__main__":
    sys.exit(main())
