"""Copying complete entries between a node-local cache and a shared one, and removing entries, atomically.

Neuron's own locking is unreliable on NFS/EFS/FSx (shared/reference/neuron-xla.md 2.3), so we never let two
writers share an entry directory. Each publisher builds the entry in its own temporary dot-name directory
(`.MODULE_<...>.tmp.<host>.<pid>.<token>`) beside the final name, fsyncs the files and the directory, and
renames it into place. rename(2) of a directory within one directory is atomic, also on an NFS server, so a
reader (Neuron looks entries up by exact name) sees either no entry or a whole one. When the final name is
already there another publisher won; we drop our temp. Removal is the reverse: rename the entry to a
`.MODULE_<...>.del.<...>` dot-name first, then delete it. Leftovers of killed processes are swept by
`clean_leftovers` when old.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_hpc.compile_cache import neuron
from megatron_hpc.compile_cache.locks import OWNER_SUFFIX, process_start_time

from megatron_hpc.errors import CompileCacheError

TMP_TAG = ".tmp."
DEL_TAG = ".del."
DEFAULT_LEFTOVER_AGE_S = 3600.0
_CHUNK = 1 << 20


@dataclass(kw_only=True, slots=True)
class TransferReport:
    copied: list[str] = field(default_factory=list)
    already_there: list[str] = field(default_factory=list)
    lost_race: list[str] = field(default_factory=list)
    """Another publisher renamed the same entry into place first; ours was dropped."""
    not_complete: list[str] = field(default_factory=list)
    """Source entries that are failed, locked or incomplete: never shared."""
    refused: dict[str, str] = field(default_factory=dict)
    """Entries holding something the compiler never writes (a symlink, a device), with the reason."""
    bytes_copied: int = 0


def inside(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """True if `path`, with every symlink resolved, lies within `root` (also resolved)."""
    real_root = os.path.realpath(root)
    return os.path.commonpath([os.path.realpath(path), real_root]) == real_root


def leftover_name(name: str, tag: str) -> str:
    return f".{name}{tag}{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"


def transfer(src_root: Path, dst_root: Path, *, group_writable: bool = False) -> TransferReport:
    """Copy every complete entry of `src_root` that `dst_root` lacks. `publish` and `sync` are this, each way."""
    if not src_root.is_dir():
        raise CompileCacheError(f"source cache {src_root} is not a directory; check --from")
    dst_root.mkdir(parents=True, exist_ok=True)
    report = TransferReport()
    for entry in neuron.scan(src_root):
        if entry.state is not neuron.State.COMPLETE:
            report.not_complete.append(entry.key)
            continue
        version_dir = dst_root / f"{neuron.VERSION_PREFIX}{entry.version}"
        if os.path.lexists(version_dir / entry.name):
            report.already_there.append(entry.key)
            continue
        _make_version_dir(version_dir, dst_root, group_writable=group_writable)
        try:
            copied = _copy_entry(entry, version_dir, group_writable=group_writable)
        except CompileCacheError as exc:
            report.refused[entry.key] = str(exc)
            continue
        if copied is None:
            report.lost_race.append(entry.key)
        else:
            report.copied.append(entry.key)
            report.bytes_copied += copied
    return report


def _make_version_dir(version_dir: Path, dst_root: Path, *, group_writable: bool) -> None:
    try:
        version_dir.mkdir()
        if group_writable:
            make_group_writable(version_dir)
    except FileExistsError:
        pass
    if version_dir.is_symlink() or not inside(version_dir, dst_root):
        raise CompileCacheError(f"{version_dir} is a symlink or leaves the cache root {dst_root}; refusing to "
                                "write through it; replace it with a real directory")


def _copy_entry(entry: neuron.Entry, version_dir: Path, *, group_writable: bool) -> int | None:
    """Build the entry under a temp name and rename it in. Bytes copied, or None if another copy won."""
    tmp = version_dir / leftover_name(entry.name, TMP_TAG)
    tmp.mkdir()
    try:
        total = 0
        for name in entry.files:
            if name.endswith((neuron.LOCK_SUFFIX, OWNER_SUFFIX)):
                continue
            total += copy_file(entry.path / name, tmp / name, group_writable=group_writable)
        if group_writable:
            make_group_writable(tmp)
        fsync_dir(tmp)
        try:
            os.rename(tmp, version_dir / entry.name)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            remove_tree(tmp, root=version_dir)
            return None
        fsync_dir(version_dir)
        return total
    except BaseException:
        with contextlib.suppress(OSError):
            remove_tree(tmp, root=version_dir)
        raise


def copy_file(src: Path, dst: Path, *, group_writable: bool) -> int:
    """Copy the regular file `src` to the new file `dst` and fsync it. Bytes copied."""
    st = os.lstat(src)
    if not stat.S_ISREG(st.st_mode):
        raise CompileCacheError(f"{src} is not a regular file (mode {stat.filemode(st.st_mode)}); the compiler "
                                "never writes those; remove the entry and recompile it")
    n = 0
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        while chunk := fin.read(_CHUNK):
            fout.write(chunk)
            n += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    if n != st.st_size:
        raise CompileCacheError(f"{src} changed size while being copied ({st.st_size} -> {n} bytes); "
                                "is something still writing the entry? retry when it is done")
    if group_writable:
        os.chmod(dst, 0o664)
    return n


def make_group_writable(path: Path) -> None:
    """g+rwx, and setgid, on a directory a team shares."""
    # setgid on directories keeps the team's group on everything created below them
    mode = os.lstat(path).st_mode
    os.chmod(path, stat.S_IMODE(mode) | stat.S_IWGRP | stat.S_IRGRP | stat.S_IXGRP | stat.S_ISGID)


def fsync_dir(path: Path) -> None:
    """Make the names created in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: str | os.PathLike, *, root: str | os.PathLike) -> int:
    """Delete the directory `path` (never a symlink's target) if it lies inside `root`. Returns bytes freed."""
    path = os.fspath(path)
    if stat.S_ISLNK(os.lstat(path).st_mode) or not inside(path, root):
        raise CompileCacheError(f"refusing to delete {path}: it is a symlink or lies outside {root}")
    freed = 0
    for dirpath, dirnames, filenames in os.walk(path, topdown=False, followlinks=False):
        if not inside(dirpath, root):  # internal invariant: walk does not follow links
            raise CompileCacheError(f"refusing to delete {dirpath}: outside {root}")
        for name in filenames:
            p = os.path.join(dirpath, name)
            freed += os.lstat(p).st_size
            os.unlink(p)
        for name in dirnames:  # links to directories are listed here but not walked
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                os.unlink(p)
            else:
                os.rmdir(p)
    os.rmdir(path)
    return freed


def remove_entry(entry: neuron.Entry, *, root: Path) -> int:
    """Make the entry vanish at once (rename to a dot-name), then delete it. Bytes freed; 0 if already gone."""
    doomed = entry.path.parent / leftover_name(entry.name, DEL_TAG)
    try:
        os.rename(entry.path, doomed)
    except FileNotFoundError:
        return 0
    return remove_tree(doomed, root=root)


@dataclass(frozen=True, kw_only=True, slots=True)
class Leftover:
    path: Path
    age_s: float
    owner_gone: bool


def find_leftovers(root: Path, *, now: float | None = None) -> list[Leftover]:
    """Temp and to-delete dot-directories of publishers and pruners, with their age and whether the writer died."""
    now = time.time() if now is None else now
    host = socket.gethostname()
    found = []
    for v in neuron.iter_version_dirs(root):
        with os.scandir(v.path) as it:
            for d in it:
                if not d.name.startswith(".") or not (TMP_TAG in d.name or DEL_TAG in d.name):
                    continue
                if not d.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    found.append(Leftover(path=Path(d.path), age_s=now - d.stat(follow_symlinks=False).st_mtime,
                                          owner_gone=writer_gone(d.name, host=host)))
    return found


def writer_gone(name: str, *, host: str | None = None) -> bool:
    """Whether the process on this host that named a temp or to-delete leftover `name` has died."""
    host = socket.gethostname() if host is None else host
    tag = TMP_TAG if TMP_TAG in name else DEL_TAG
    try:
        writer_host, pid, _token = name.rsplit(tag, 1)[1].rsplit(".", 2)
        return writer_host == host and process_start_time(int(pid)) is None
    except ValueError:
        return False


def clean_leftovers(root: Path, *, older_than: float = DEFAULT_LEFTOVER_AGE_S, now: float | None = None,
                    dry_run: bool = False) -> list[Path]:
    """Remove leftovers older than `older_than` seconds, or whose writer on this host is dead."""
    removed = []
    for left in find_leftovers(root, now=now):
        if left.age_s > older_than or left.owner_gone:
            if not dry_run:
                with contextlib.suppress(FileNotFoundError):
                    remove_tree(left.path, root=root)
            removed.append(left.path)
    return removed
