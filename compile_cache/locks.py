"""Entry locks with owner records, and deciding whether a lock is stale.

A killed compile leaves a 0-byte `model.hlo_module.pb.lock` and every later run waits on it forever
(shared/reference/neuron-xla.md 2.3, the top user problem). Neuron's locks say nothing about their owner, so
the locks we take get an owner record beside them, `<lock>.owner`: host, boot id, pid and the process start
time from /proc/<pid>/stat (a pid alone can be reused). The rules, in `lock_status`:

- our lock, owner on this host: stale when the owner is gone (pid dead or a zombie, start time or boot id
  differs). A live owner is never stale, however old the lock;
- our lock, owner on another host: we cannot look, so stale only when older than `stale_after`;
- a foreign lock (no owner record, what neuronx-cc writes): stale only when older than `stale_after` AND no
  `neuronx-cc` process runs on this host, the check optimum-neuron's cleanup does with `pgrep` (2.3).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_hpc.atomic_write import write_json_atomic
from megatron_hpc.errors import CompileCacheError

OWNER_SUFFIX = ".owner"
BREAK_SUFFIX = ".break"
COMPILER_NAME = "neuronx-cc"
DEFAULT_STALE_AFTER_S = 3600.0
_BREAK_MUTEX_STALE_S = 60.0  # judging and removing one lock takes milliseconds


@dataclass(frozen=True, kw_only=True, slots=True)
class Owner:
    host: str
    boot_id: str
    pid: int
    start_time: int
    """Field 22 of /proc/<pid>/stat: clock ticks after boot when the process started."""
    created: float


@dataclass(frozen=True, kw_only=True, slots=True)
class LockStatus:
    path: Path
    stale: bool
    reason: str
    age_s: float
    owner: Owner | None
    ident: tuple[int, int] = (0, 0)
    """(inode, mtime in ns) of the lock file judged, so a lock replaced meanwhile is told apart."""


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start_time(pid: int) -> int | None:
    """Start time of a running process, or None if there is none (a zombie counts as gone)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    fields = raw[raw.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def current_owner() -> Owner:
    pid = os.getpid()
    start = process_start_time(pid)
    if start is None:  # internal invariant: we are running, so /proc/self exists
        raise CompileCacheError("cannot read /proc/self/stat; owner records need Linux /proc")
    return Owner(host=socket.gethostname(), boot_id=boot_id(), pid=pid, start_time=start, created=time.time())


def read_owner(lock: Path) -> Owner | None:
    """The owner record beside `lock`, or None if there is none or it is unreadable."""
    try:
        data = json.loads(Path(f"{lock}{OWNER_SUFFIX}").read_text())
        return Owner(host=str(data["host"]), boot_id=str(data["boot_id"]), pid=int(data["pid"]),
                     start_time=int(data["start_time"]), created=float(data["created"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def compiler_running() -> bool:
    """True if a `neuronx-cc` process runs on this host (like `pgrep neuronx-cc`, plus `python .../neuronx-cc`)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "comm").read_text().strip() == COMPILER_NAME:
                return True
            argv = (proc / "cmdline").read_bytes().split(b"\0")[:3]
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if any(os.path.basename(a.decode(errors="replace")) == COMPILER_NAME for a in argv):
            return True
    return False


def lock_status(lock: Path, *, stale_after: float = DEFAULT_STALE_AFTER_S, now: float | None = None,
                compiler_alive: bool | None = None) -> LockStatus:
    """Whether `lock` is stale, and why. `compiler_alive` is looked up when needed and not given."""
    now = time.time() if now is None else now
    try:
        st = os.lstat(lock)
    except FileNotFoundError:
        return LockStatus(path=lock, stale=False, reason="released", age_s=0.0, owner=None)
    age, ident = now - st.st_mtime, (st.st_ino, st.st_mtime_ns)
    owner = read_owner(lock)
    if owner is not None:
        stale, reason = _owned_lock_verdict(owner, age=age, stale_after=stale_after)
    elif age <= stale_after:
        stale, reason = False, f"no owner record, {age:.0f}s old (<= {stale_after:.0f}s): may be compiling"
    elif compiler_alive if compiler_alive is not None else compiler_running():
        stale, reason = False, f"no owner record and {COMPILER_NAME} runs on this host"
    else:
        stale, reason = True, f"no owner record, {age:.0f}s old and no {COMPILER_NAME} on this host"
    return LockStatus(path=lock, stale=stale, reason=reason, age_s=age, owner=owner, ident=ident)


def _owned_lock_verdict(owner: Owner, *, age: float, stale_after: float) -> tuple[bool, str]:
    who = f"pid {owner.pid} on {owner.host}"
    if owner.host != socket.gethostname():
        if age > stale_after:
            return True, f"{who}, another host, {age:.0f}s old (> {stale_after:.0f}s)"
        return False, f"{who}, another host, {age:.0f}s old (<= {stale_after:.0f}s)"
    if owner.boot_id and owner.boot_id != boot_id():
        return True, f"{who} from before the last reboot"
    start = process_start_time(owner.pid)
    if start is None:
        return True, f"{who} is gone"
    if start != owner.start_time:
        return True, f"{who} is gone (pid reused by a process started at tick {start})"
    return False, f"held by live {who}"


def break_lock(status: LockStatus) -> bool:
    """Remove a lock judged stale, and its owner record. False if it changed meanwhile (then it is kept).

    Two cleaners must not both judge the same dead lock and one of them then delete the fresh lock a new owner
    took in between, so the re-check and removal run under a short `<lock>.break` mutex.
    """
    if not status.stale:  # internal invariant: callers only pass stale verdicts
        raise CompileCacheError(f"refusing to remove {status.path}: {status.reason}")
    mutex = Path(f"{status.path}{BREAK_SUFFIX}")
    with _exclusive_file(mutex, stale_after=_BREAK_MUTEX_STALE_S) as got:
        if not got:
            return False
        try:
            st = os.lstat(status.path)
        except FileNotFoundError:
            return True
        if (st.st_ino, st.st_mtime_ns) != status.ident or read_owner(status.path) != status.owner:
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(status.path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{status.path}{OWNER_SUFFIX}")
    return True


@contextlib.contextmanager
def _exclusive_file(path: Path, *, stale_after: float) -> Iterator[bool]:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o664))
    except FileExistsError:
        try:
            if time.time() - os.lstat(path).st_mtime > stale_after:
                os.unlink(path)  # a cleaner died inside the few milliseconds it holds this
        except FileNotFoundError:
            pass
        yield False
        return
    try:
        yield True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def hold(lock: Path, *, wait_s: float = 0.0, poll_s: float = 0.1,
         stale_after: float = DEFAULT_STALE_AFTER_S) -> Iterator[Path]:
    """Take `lock` (O_EXCL create) and write our owner record beside it; release both on exit.

    Waits up to `wait_s` for a live holder, and breaks a stale lock on the way. Raises CompileCacheError when
    the lock is still held after `wait_s`.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o664)
            break
        except FileExistsError:
            status = lock_status(lock, stale_after=stale_after)
            if status.stale and break_lock(status):
                continue
            if time.monotonic() >= deadline:
                raise CompileCacheError(f"{lock} is held ({status.reason}); wait for it to finish, or run "
                                        "`megatron-hpc cache clear-locks` if its owner is gone") from None
            time.sleep(poll_s)
    os.close(fd)
    _write_owner(lock, current_owner())
    try:
        yield lock
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{lock}{OWNER_SUFFIX}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)


def _write_owner(lock: Path, owner: Owner) -> None:
    # a reader sees no record or a whole one, never half
    write_json_atomic(Path(f"{lock}{OWNER_SUFFIX}"), asdict(owner), indent=None)
