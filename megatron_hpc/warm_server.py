"""The warm process of one node: torch and the trainer imported once, workers forked on request.

    python -m megatron_hpc.warm_server [--folder DIR]

The in-job driver (launch/in_job.py) starts it once per allocation on every node (node.sh's warm phase, one
SLURM step beside the worker steps). A restarted step's workers then start without a new interpreter, a new
torchrun and a second torch import (a restart on the test cluster: 2.9 s instead of 7.4 s, benchmarks/
RESULTS.md, issue 28). The protocol is megatron_hpc/warm_protocol.py's; launch/warm_client.py is the other end.

Forking is safe only from a process with one thread that holds no device: this process imports torch and the
trainer's modules but initialises no CUDA or XLA runtime and starts no thread pool (torch's intra-op pool starts
at the first parallel op, in each worker; numpy's OpenBLAS would start one at import, so it gets one thread here).
It refuses to serve when it has more than one thread anyway (its clients start the workers cold). Not for XLA
platforms: torch_xla must not be imported before a fork, and importing it is most of what this saves.

Each forked worker gets the client's stdout and stderr, its cwd, CPU affinity and environment (one per local
rank, as torchrun sets them), and dies with this process (PR_SET_PDEATHSIG). It ends as an interpreter would
(non-daemon threads joined, atexit handlers run, a SystemExit message printed). Like torchrun, when one worker of
a request fails, the others get SIGTERM and KILL_GRACE_S later SIGKILL; when the client's connection closes (srun
killed the step it ran in) the request's workers get SIGKILL at once, since they are not in that step.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import importlib
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_hpc.warm_protocol import (
    KILL_GRACE_S,
    PID_NAME,
    REFUSED_NAME,
    REGISTRY_GLOB,
    SOCKET_NAME,
    LineReader,
    WarmWorker,
    encode,
    remove_registry,
    socket_problem,
    warm_folder,
    write_registry,
)

REQUEST_TIMEOUT_S = 10.0
PRELOAD = ("torch", "torch.distributed", "torch.optim", "torch._dynamo", "megatron_hpc.cli.main",
           "megatron_hpc.cli.train_cmd", "megatron_hpc.train.entry", "megatron_hpc.recipes")
"""What a worker imports before its first step (`python -m megatron_hpc train`). torch._dynamo is imported late, by
torch.optim.Optimizer's constructor (with sympy: 1.7 s of a 2.3 s tiny run's start here, benchmarks/RESULTS.md)."""
_PR_SET_PDEATHSIG = 1


@dataclass(kw_only=True, slots=True)
class Request:
    conn: socket.socket | None
    workers: dict[int, int] = field(default_factory=dict)
    """pid -> local rank, while it runs."""
    reader: LineReader = field(default_factory=LineReader)
    failed: bool = False
    """A worker failed (or the client left): the others are being ended."""
    kill_at: float | None = None


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def preload() -> None:
    # numpy's OpenBLAS starts its threads when torch imports numpy; a fork keeps none of them, so none may run.
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    for name in PRELOAD:
        importlib.import_module(name)


def _run_dir_of(argv: list[str], cwd: str) -> str:
    given = argv[argv.index("--run-dir") + 1] if "--run-dir" in argv[:-1] else "."
    return os.path.realpath(os.path.join(cwd, given))


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the warm process died before prctl took effect
        os._exit(1)


def _fresh_random_state() -> None:
    """numpy's global generator seeded from the OS, as a new interpreter's is: a fork copies the warm process's
    state, and every worker would draw the same numbers. (Python's `random` reseeds itself in a forked child; the
    str hash seed stays the warm process's, fixed when an interpreter starts; torch's default generator needs
    nothing: a new interpreter's starts from a fixed seed too, which the warm process never draws from.)"""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _exit_status(code: object) -> int:
    """SystemExit's code as the interpreter turns it into a status: a message is printed, and fails."""
    if code is None or isinstance(code, int):
        return code or 0
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def _finalize(code: int) -> int:
    """What the interpreter does at exit before its status (Py_FinalizeEx), which os._exit skips: join the
    non-daemon threads (the checkpoint writer's), run the atexit handlers, flush stdout and stderr."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own wait for non-daemon threads
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = code or 1
    atexit._run_exitfuncs()  # prints a failing handler's traceback itself, as at a normal exit
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    return code


class Server:
    def __init__(self, folder: Path, listener: socket.socket):
        self.folder, self.listener = folder, listener
        self.requests: list[Request] = []
        self.stopping = False
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    # ------------------------------------------------------------------------------------------- the loop

    def serve(self) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector (the wakeup fd)
        signal.signal(signal.SIGTERM, self._on_term)
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        while not (self.stopping and not self.requests):
            if self.stopping and self.listener.fileno() >= 0:
                self.selector.unregister(self.listener)
                self.listener.close()
                (self.folder / SOCKET_NAME).unlink(missing_ok=True)  # a new client starts its workers cold,
                with contextlib.suppress(OSError):  # at once, not after waiting for this live process to listen
                    (self.folder / REFUSED_NAME).write_text("it got SIGTERM and only serves its running workers to "
                                                            "their end\n")
            for key, _ in self.selector.select(self._timeout()):
                if key.data == "accept":
                    self.accept()
                elif key.data == "wake":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 4096)
                else:
                    self.read_client(key.data)
            self.reap()
            self.enforce_grace()

    def _on_term(self, signum: int, frame: object) -> None:
        # A job-level TERM (preemption, requeue) reaches the workers itself: they save; serve them to the end.
        self.stopping = True

    def _timeout(self) -> float | None:
        deadlines = [r.kill_at for r in self.requests if r.kill_at is not None]
        if deadlines:
            return max(0.0, min(deadlines) - time.monotonic())
        return 0.5 if self.stopping else None

    def accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        conn.settimeout(REQUEST_TIMEOUT_S)
        fds: list[int] = []
        request = Request(conn=conn)
        self.requests.append(request)  # before forking: each child closes every request's connection
        try:
            conn.sendall(encode({"hello": os.getpid()}))  # the client sends its descriptors only after it
            message, fds = self._read_request(conn)
            self.spawn(request, message, fds)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            with contextlib.suppress(OSError):
                conn.sendall(encode({"error": f"bad request: {exc}"}))
            self.signal_workers(request, signal.SIGKILL)  # any forked before the failure
            request.conn, request.failed = None, True
            conn.close()
            if not request.workers:
                self.requests.remove(request)
            return
        finally:
            for fd in fds:
                os.close(fd)
        self.selector.register(conn, selectors.EVENT_READ, request)
        # A client already gone (srun ended its step as it started) is one whose workers go: never this process.
        self.send(request, {"started": [{"local_rank": r, "pid": p} for p, r in request.workers.items()]})

    @staticmethod
    def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
        reader = LineReader()
        messages = reader.feed(data)
        while not messages:
            more = conn.recv(1 << 16)
            if not more:
                raise ValueError("the client closed the connection before its request ended")
            messages = reader.feed(more)
        if len(fds) != 2:
            raise ValueError(f"{len(fds)} file descriptors passed, 2 expected (stdout, stderr)")
        return messages[0], list(fds)

    # --------------------------------------------------------------------------------------------- workers

    def spawn(self, request: Request, message: dict, fds: list[int]) -> None:
        argv, cwd, envs = [str(a) for a in message["argv"]], str(message["cwd"]), list(message["envs"])
        if len(argv) < 2 or argv[0] != "-m":
            raise ValueError(f"argv {argv} does not start with -m MODULE")
        affinity = set(message.get("affinity") or ())
        run_dir = _run_dir_of(argv, cwd)
        sys.stdout.flush()
        sys.stderr.flush()  # what is buffered here would be written again by every child
        server = os.getpid()  # taken here: a child's getppid() is already init's once this process died
        for local_rank, env in enumerate(envs):
            pid = os.fork()
            if pid == 0:
                self._become_worker(argv=argv, cwd=cwd, env=env, affinity=affinity, fds=fds, server=server)
            with contextlib.suppress(OSError):
                os.setpgid(pid, pid)  # also in the child: whichever runs first
            request.workers[pid] = local_rank
            write_registry(self.folder, WarmWorker(rank=int(env["RANK"]), pid=pid, server_pid=os.getpid(),
                                                   run_dir=run_dir))

    def _become_worker(self, *, argv: list[str], cwd: str, env: dict, affinity: set[int], fds: list[int],
                       server: int) -> None:
        code: object = 1
        try:
            os.setpgid(0, 0)
            _die_with_parent(server)
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            # SIGUSR2 stays ignored until the trainer's handler, as for torchrun's workers under node.sh.
            self.listener.close()
            for other in self.requests:
                if other.conn is not None:
                    other.conn.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            self.selector.close()
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update({str(k): str(v) for k, v in env.items()})
            _fresh_random_state()
            if affinity:
                with contextlib.suppress(OSError):  # CPUs this step's cgroup does not hold: keep its own
                    os.sched_setaffinity(0, affinity)
            sys.path[0] = cwd  # where `python -m` puts the folder it started in
            sys.argv = [argv[1], *argv[2:]]  # runpy makes argv[0] the module's file, as `python -m` does
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = _exit_status(exc.code)
        except BaseException:  # a worker reports any error on its stderr, as an interpreter would
            sys.excepthook(*sys.exc_info())
            code = 1
        finally:
            os._exit(_finalize(code))

    def _owner(self, pid: int) -> Request | None:
        return next((r for r in self.requests if pid in r.workers), None)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            remove_registry(self.folder, pid)
            request = self._owner(pid)
            if request is None:
                continue
            local_rank = request.workers.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            first = not request.failed
            if code != 0 and not request.failed:
                self.end_request(request, signal.SIGTERM)
            self.send(request, {"exit": {"local_rank": local_rank, "pid": pid, "code": code, "first": first}})
            if not request.workers:
                self.close(request)

    def end_request(self, request: Request, sig: int) -> None:
        request.failed = True
        self.signal_workers(request, sig)
        if sig != signal.SIGKILL and request.workers:
            request.kill_at = time.monotonic() + KILL_GRACE_S

    def enforce_grace(self) -> None:
        now = time.monotonic()
        for request in self.requests:
            if request.kill_at is not None and now >= request.kill_at:
                request.kill_at = None
                self.signal_workers(request, signal.SIGKILL)

    @staticmethod
    def signal_workers(request: Request, sig: int) -> None:
        for pid in request.workers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)

    # --------------------------------------------------------------------------------------- the client side

    def read_client(self, request: Request) -> None:
        try:
            data = request.conn.recv(4096) if request.conn is not None else b""
        except OSError:
            data = b""
        if not data:  # the client is gone (srun killed its step): its workers go too
            self.drop_connection(request)
            self.end_request(request, signal.SIGKILL)
            return
        for message in request.reader.feed(data):
            if "signal" in message:
                self.signal_workers(request, int(message["signal"]))

    def send(self, request: Request, message: dict) -> None:
        if request.conn is None:
            return
        try:
            request.conn.sendall(encode(message))
        except OSError:
            self.drop_connection(request)
            self.end_request(request, signal.SIGKILL)

    def drop_connection(self, request: Request) -> None:
        if request.conn is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(request.conn)
            request.conn.close()
            request.conn = None

    def close(self, request: Request) -> None:
        self.drop_connection(request)
        self.requests.remove(request)


# ------------------------------------------------------------------------------------------------- start


def say(text: str) -> None:
    print(f"megatron-hpc: warm workers: {text}", flush=True)


def prepare_folder(folder: Path) -> str | None:
    """The folder, private to this user, with this process's pid file; why not, or None."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if folder.stat().st_uid != os.getuid():
            return f"{folder} belongs to another user; set TMPDIR to a folder of yours on this node"
        for stale in (SOCKET_NAME, REFUSED_NAME):  # an earlier attempt's, on this node
            (folder / stale).unlink(missing_ok=True)
        (folder / PID_NAME).write_text(str(os.getpid()))
    except OSError as exc:
        return f"cannot prepare {folder}: {exc}"
    return None


def listen(path: Path) -> socket.socket:
    """Listening at `path` only once ready: bound under another name, renamed into place, so a client never
    connects to a server that is still importing."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp))
    listener.listen(64)
    os.rename(tmp, path)
    return listener


def cleanup(folder: Path, *, refused: str | None = None) -> None:
    """The folder goes with its warm process (a later one of the same job, after a requeue, makes its own); one
    that refused to serve leaves why, so that its clients do not wait for it."""
    with contextlib.suppress(OSError):
        if (folder / PID_NAME).read_text().strip() != str(os.getpid()):
            return
        (folder / SOCKET_NAME).unlink(missing_ok=True)
        for record in folder.glob(REGISTRY_GLOB):
            record.unlink(missing_ok=True)
        if refused:
            (folder / REFUSED_NAME).write_text(refused + "\n")
        else:  # the draining note (Server.serve)
            (folder / REFUSED_NAME).unlink(missing_ok=True)
        (folder / PID_NAME).unlink()
        if not refused:
            folder.rmdir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_hpc.warm_server",
                                     description="Import torch and the trainer once; fork workers on request.")
    parser.add_argument("--folder", type=Path, default=None,
                        help="node-local folder of the socket (default: from SLURM_JOB_ID and SLURMD_NODENAME)")
    args = parser.parse_args(argv)
    # SLURM's warning signal before the time limit reaches every step of the job, this one too: it is the
    # workers' to act on (they got it as well).
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    folder = args.folder or warm_folder(os.environ)
    if folder is None:
        say("not started: SLURM_JOB_ID and SLURMD_NODENAME are unset (run inside a job step, or pass --folder)")
        return 2
    problem = socket_problem(folder / SOCKET_NAME) or prepare_folder(folder)
    if problem:
        say(f"not started: {problem}")
        return 1
    refused = None
    try:
        started = time.monotonic()
        preload()
        threads = thread_count()
        if threads != 1:
            refused = f"{threads} threads after importing torch (a fork keeps only one)"
            say(f"not serving: {refused}; the workers start cold")
            return 1
        listener = listen(folder / SOCKET_NAME)
        say(f"ready on {socket.gethostname()} in {time.monotonic() - started:.2f} s (torch and the trainer "
            f"imported): {folder / SOCKET_NAME}")
        Server(folder, listener).serve()
    except Exception as exc:
        refused = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        cleanup(folder, refused=refused)
    return 0


if __name__ == "__main__":
    sys.exit(main())
