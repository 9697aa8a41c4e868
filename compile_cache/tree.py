"""Publish and sync a compile cache that is a plain tree of files (TorchInductor's, Triton's), file by file.

Inductor keeps content-addressed files in bucket folders that gain files run after run (`<root>/ab/cab....py`
and `.so`, `fxgraph/<..>/<key>/<hash>`, `aotautograd/<key>/<hash>`), so unlike a Neuron entry (store.py) there
is no directory to build aside and rename into place. Here each regular file is an entry. It is copied under
a temporary dot-name beside its final name, fsynced, and hard-linked to the final name, then the temp name is
unlinked. link(2) is atomic, also on an NFS server, and fails when the name exists: a reader sees a whole file
or none, and a file another publisher put there first is never replaced. That is the guarantee Inductor's own
writes give (temp file, then rename), so it reads our copies as it reads its own.

Triton writes a kernel's files and then a `__grp__<name>.json` listing them; group files are copied after the
other files of their folder, so a visible group never names a missing file. (The launcher does not share
Triton's cache between different paths, see paths.py; a person may, between caches at the same path.)

Never copied: dot-names (temp files of Inductor and of publishers), `tmp.*` folders (Triton's and Inductor's
temp folders), `*.lock` files (filelock's: the lock is a flock held by a live process, the file alone means
nothing) and anything that is not a regular file or a directory (refused: the compilers never write symlinks,
and one could lead a copy out of the cache).

For `cache ls | stats | prune` the entries are what is published atomically: each shareable file, except that
the files of a folder holding group files form one entry (`<folder>/`), since Triton reads them together.
Removal is the reverse of publishing: group files first, so a visible group never names a missing file. Files
are removed through directory descriptors opened with O_NOFOLLOW, so a symlink swapped in for a folder after the
scan cannot lead a removal out of the root. Inductor and Triton look files up by name and compile again what is
missing, so removing any entry costs a recompile, never a wrong result.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from megatron_hpc.compile_cache import store

from megatron_hpc.errors import CompileCacheError

GROUP_PREFIX = "__grp__"
TEMP_DIR_PREFIX = "tmp."
LOCK_SUFFIX = ".lock"
# Filesystems without hard links say so with one of these; there we rename instead (see _place).
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS}


@dataclass(kw_only=True, slots=True)
class Folder:
    """One directory of the source tree: its path relative to the root and the files to share, in copy order."""

    rel: str
    files: list[str] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class Walk:
    folders: list[Folder] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)


def walk(root: Path) -> Walk:
    """The folders and shareable files under `root`, never following a symlink; what cannot be shared, refused."""
    result = Walk()
    pending = [""]
    while pending:
        rel = pending.pop()
        folder = Folder(rel=rel)
        try:
            it = os.scandir(root / rel if rel else root)
        except FileNotFoundError:  # removed while we walked
            continue
        with it:
            for d in it:
                name_rel = f"{rel}/{d.name}" if rel else d.name
                if d.name.startswith("."):
                    continue
                if d.is_dir(follow_symlinks=False):
                    if not d.name.startswith(TEMP_DIR_PREFIX):
                        pending.append(name_rel)
                elif d.is_file(follow_symlinks=False):
                    if not d.name.endswith(LOCK_SUFFIX):
                        folder.files.append(d.name)
                else:
                    result.refused[name_rel] = ("a symlink or special file; compilers write regular files only, "
                                                "so it is not shared; remove it from the source cache")
        folder.files.sort(key=lambda n: (n.startswith(GROUP_PREFIX), n))
        result.folders.append(folder)
    result.folders.sort(key=lambda f: f.rel)
    return result


def transfer(src_root: Path, dst_root: Path, *, group_writable: bool = False) -> store.TransferReport:
    """Copy every file of the tree `src_root` that `dst_root` lacks; `publish` and `sync` are this, each way."""
    if not src_root.is_dir():
        raise CompileCacheError(f"source cache {src_root} is not a directory; check --from")
    dst_root.mkdir(parents=True, exist_ok=True)
    tree = walk(src_root)
    report = store.TransferReport(refused=dict(tree.refused))
    for folder in tree.folders:
        there = {n for n in folder.files if os.path.lexists(_join(dst_root, folder.rel, n))}
        report.already_there += [_rel(folder.rel, n) for n in folder.files if n in there]
        todo = [n for n in folder.files if n not in there]  # in copy order: group files last
        if not todo:
            continue
        try:
            dst_dir = _make_dirs(dst_root, folder.rel, group_writable=group_writable)
        except CompileCacheError as exc:
            report.refused.update({_rel(folder.rel, n): str(exc) for n in todo})
            continue
        for name in todo:
            rel = _rel(folder.rel, name)
            try:
                copied = _copy(src_root / rel, dst_dir, name, group_writable=group_writable)
            except FileNotFoundError:  # gone from the source meanwhile: nothing to share
                continue
            except CompileCacheError as exc:
                report.refused[rel] = str(exc)
                continue
            if copied is None:
                report.lost_race.append(rel)
            else:
                report.copied.append(rel)
                report.bytes_copied += copied
    return report


def _rel(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def _join(root: Path, folder: str, name: str) -> str:
    return os.path.join(root, folder, name) if folder else os.path.join(root, name)


def _make_dirs(dst_root: Path, rel: str, *, group_writable: bool) -> Path:
    """Create dst_root/rel one level at a time, refusing to write through a symlink or out of the root."""
    path = dst_root
    for part in rel.split("/") if rel else ():
        path = path / part
        try:
            path.mkdir()
            if group_writable:
                store.make_group_writable(path)
        except FileExistsError:
            pass
        if path.is_symlink() or not path.is_dir():
            raise CompileCacheError(f"{path} is a symlink or not a directory; refusing to write through it; "
                                    "replace it with a real directory")
    if not store.inside(path, dst_root):
        raise CompileCacheError(f"{path} leaves the cache root {dst_root}; refusing to write there")
    return path


def _copy(src: Path, dst_dir: Path, name: str, *, group_writable: bool) -> int | None:
    """Copy `src` to dst_dir/name atomically. Bytes copied, or None when another publisher put it there first."""
    tmp = dst_dir / store.leftover_name(name, store.TMP_TAG)
    try:
        n = store.copy_file(src, tmp, group_writable=group_writable)
        placed = _place(tmp, dst_dir / name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if placed:
        store.fsync_dir(dst_dir)
    return n if placed else None


def _place(tmp: Path, final: Path) -> bool:
    """Give the finished temp file its final name unless that exists. True when ours is the one in place."""
    try:
        os.link(tmp, final)
        return True
    except FileExistsError:
        # NFS: when the reply to a LINK that succeeded is lost, the retry answers EEXIST; the file is ours then
        with contextlib.suppress(OSError):
            return os.path.samestat(os.lstat(tmp), os.lstat(final))
        return False
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
    # No hard links here: rename. Two publishers may both rename the same name, the later replacing the earlier
    # file whole (rename is atomic), which for content-addressed files means the same bytes again.
    if os.path.lexists(final):
        return False
    os.rename(tmp, final)
    return True


def find_leftovers(root: Path, *, now: float | None = None) -> Iterator[store.Leftover]:
    """Temp files of publishers (killed ones leave them), with their age and whether the writer died."""
    now = time.time() if now is None else now
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") and store.TMP_TAG in name:
                path = Path(dirpath, name)
                with contextlib.suppress(FileNotFoundError):
                    st = os.lstat(path)
                    if stat.S_ISREG(st.st_mode):
                        yield store.Leftover(path=path, age_s=now - st.st_mtime, owner_gone=store.writer_gone(name))


def clean_leftovers(root: Path, *, older_than: float = store.DEFAULT_LEFTOVER_AGE_S, now: float | None = None,
                    dry_run: bool = False) -> list[Path]:
    """Remove temp files older than `older_than` seconds, or whose writer on this host is dead."""
    removed = []
    for left in find_leftovers(root, now=now):
        if left.age_s > older_than or left.owner_gone:
            if not dry_run:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(left.path)
            removed.append(left.path)
    return removed


@dataclass(frozen=True, kw_only=True, slots=True)
class TreeEntry:
    """One file, or one folder whose files go together (it holds group files); what ls lists and prune removes."""

    key: str
    """Path relative to the root; a folder entry's ends with `/`."""
    files: tuple[str, ...]
    """Paths relative to the root, in removal order (group files first)."""
    size: int
    last_used: float
    """Newest atime or mtime of its files: what LRU pruning sorts by."""


def scan(root: Path) -> Iterator[TreeEntry]:
    """The entries of the tree at `root`, one directory listing per folder and one lstat per file."""
    for folder in walk(root).folders:
        stats = {}
        for name in folder.files:
            with contextlib.suppress(FileNotFoundError):  # removed since the listing
                stats[_rel(folder.rel, name)] = os.lstat(_join(root, folder.rel, name))
        if not stats:
            continue
        if folder.rel and any(n.startswith(GROUP_PREFIX) for n in folder.files):
            order = sorted(stats, key=lambda rel: not rel.rsplit("/", 1)[-1].startswith(GROUP_PREFIX))
            yield TreeEntry(key=folder.rel + "/", files=tuple(order), size=sum(st.st_size for st in stats.values()),
                            last_used=max(max(st.st_atime, st.st_mtime) for st in stats.values()))
            continue
        for rel, st in stats.items():
            yield TreeEntry(key=rel, files=(rel,), size=st.st_size, last_used=max(st.st_atime, st.st_mtime))


def remove_entry(entry: TreeEntry, *, root: Path) -> int:
    """Unlink the entry's files in order, never through a symlink or outside `root`. Bytes freed."""
    return sum(_unlink_beneath(root, rel) for rel in entry.files)


def _unlink_beneath(root: Path, rel: str) -> int:
    """Unlink the regular file root/rel, walking down with O_NOFOLLOW directory descriptors. Bytes freed; 0 if gone."""
    *parts, name = rel.split("/")
    if any(p in ("", ".", "..") for p in (*parts, name)):
        raise CompileCacheError(f"{rel!r} is not a plain path inside the cache; refusing to remove it")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts:
            try:
                next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                return 0
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW on a symlink, or not a folder
                    raise
                raise CompileCacheError(f"{root / rel}: {part} is a symlink or not a directory; refusing to "
                                        "remove through it") from None
            os.close(fd)
            fd = next_fd
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return 0
        if not stat.S_ISREG(st.st_mode):
            raise CompileCacheError(f"{root / rel} is not a regular file; refusing to remove it")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=fd)
            return st.st_size
        return 0
    finally:
        os.close(fd)


def remove_empty_folders(root: Path, *, older_than: float = store.DEFAULT_LEFTOVER_AGE_S, now: float | None = None,
                         dry_run: bool = False) -> list[Path]:
    """Remove folders below `root` that are empty and unchanged for `older_than` seconds.

    The compilers create a folder just before writing into it, so one that stayed empty that long is nobody's.
    Emptying a folder changes it: a folder a prune empties goes in a later prune. rmdir leaves a folder that
    gained a file meanwhile, and never follows a symlink.
    """
    now = time.time() if now is None else now
    removed = []
    for dirpath, _dirnames, _filenames in os.walk(root, topdown=False, followlinks=False):
        path = Path(dirpath)
        if path == root:
            continue
        try:
            if os.listdir(path) or now - os.lstat(path).st_mtime <= older_than:
                continue
            if not dry_run:
                os.rmdir(path)
        except OSError:  # gone, or no longer empty
            continue
        removed.append(path)
    return removed
