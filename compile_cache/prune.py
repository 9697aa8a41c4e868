"""Everything that deletes from a cache: pruning old or excess entries, failed entries and stale locks.

"Currently there's no automatic maintenance of cache size" (shared/reference/neuron-xla.md 2.6), and cached
failures and stale locks block later runs (2.3, 2.4). Every removal goes through store.remove_entry,
tree.remove_entry or locks.break_lock: Neuron entries vanish at once by rename, tree entries file by file (group
files first), symlinks are never followed, nothing outside the root is touched, and a live lock (or an entry
holding one) is never removed.

Pruning a launcher root also drops its compile fingerprints (fingerprint.py) once it removed anything: a
fingerprint says the cache holds every graph of a run, which may no longer be true, and a compile phase that
finds the rest in the cache is cheap next to a run that compiles on the fly.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_hpc.compile_cache import fingerprint, layouts, locks, neuron, store, tree
from megatron_hpc.compile_cache.paths import LAUNCHER_LAYOUT, Layout

from megatron_hpc.errors import CompileCacheError


@dataclass(kw_only=True, slots=True)
class PruneReport:
    removed: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    kept_locked: list[str] = field(default_factory=list)
    """Entries in use (or with a lock to clear first); pruning never touches them."""
    bytes_left: int = 0
    leftovers_removed: list[str] = field(default_factory=list)
    folders_removed: list[str] = field(default_factory=list)
    """Tree folders left empty (and unchanged) for longer than the leftover age."""
    fingerprints_removed: list[str] = field(default_factory=list)
    """A launcher root's compile fingerprints, dropped because entries were removed."""
    refused: dict[str, str] = field(default_factory=dict)
    """Entries left in place because removing them would go through a symlink or out of the root, with why."""


def prune(root: Path, *, layout: Layout = "neuron", older_than: float | None = None, max_size: int | None = None,
          now: float | None = None, dry_run: bool = False,
          leftover_age: float = store.DEFAULT_LEFTOVER_AGE_S) -> PruneReport:
    """Remove entries unused for `older_than` seconds, then least recently used ones until the cache holds at
    most `max_size` bytes. Locked entries are kept and still count toward the size. In a launcher root the
    Neuron and Inductor entries are pruned together, least recently used first."""
    now = time.time() if now is None else now
    report = PruneReport()
    report.leftovers_removed = [str(p) for p in layouts.clean_leftovers(root, layout=layout, older_than=leftover_age,
                                                                        now=now, dry_run=dry_run)]
    entries = sorted(layouts.entries(root, layout=layout), key=lambda e: e.last_used)  # least recently used first
    total = sum(e.size for e in entries)
    for entry in entries:
        if entry.state == neuron.State.LOCKED.value:
            report.kept_locked.append(entry.key)
            continue
        too_old = older_than is not None and now - entry.last_used > older_than
        too_big = max_size is not None and total > max_size
        if not (too_old or too_big):
            continue
        try:
            freed = entry.size if dry_run else entry.remove()
        except CompileCacheError as exc:
            report.refused[entry.key] = str(exc)
            continue
        report.removed.append(entry.key)
        report.bytes_freed += freed
        total -= entry.size
    report.bytes_left = total
    for _folder, part_root, sub in layouts.parts(root, layout=layout):
        if sub == "tree":
            report.folders_removed += [str(p) for p in tree.remove_empty_folders(part_root, older_than=leftover_age,
                                                                                 now=now, dry_run=dry_run)]
    if report.removed:
        launcher_root = root if layout == "launcher" else _launcher_root_of(root)
        if launcher_root is not None:
            report.fingerprints_removed = fingerprint.remove_all(launcher_root, dry_run=dry_run)
    return report


def clear_failed(root: Path, *, dry_run: bool = False) -> list[str]:
    """Remove the FAILED entries so their graphs are compiled again (the remedy in neuron-xla.md 2.4)."""
    removed = []
    for entry in neuron.scan(root):
        if entry.state is neuron.State.FAILED:
            if not dry_run:
                store.remove_entry(entry, root=root)
            removed.append(entry.key)
    return removed


@dataclass(kw_only=True, slots=True)
class ClearLocksReport:
    cleared: list[locks.LockStatus] = field(default_factory=list)
    kept: list[locks.LockStatus] = field(default_factory=list)
    orphan_records: list[str] = field(default_factory=list)


def clear_locks(root: Path, *, stale_after: float = locks.DEFAULT_STALE_AFTER_S, dry_run: bool = False,
                now: float | None = None) -> ClearLocksReport:
    """Remove the stale locks of every entry; keep (and report) the live ones."""
    report = ClearLocksReport()
    compiler_alive: bool | None = None  # looked up once, and only if a foreign lock needs it
    for entry in neuron.scan(root):
        for name in entry.locks:
            lock = entry.path / name
            if compiler_alive is None and locks.read_owner(lock) is None:
                compiler_alive = locks.compiler_running()
            status = locks.lock_status(lock, stale_after=stale_after, now=now, compiler_alive=compiler_alive)
            if status.stale and (dry_run or locks.break_lock(status)):
                report.cleared.append(status)
            else:
                report.kept.append(status)
        for name in entry.files:
            record = entry.path / name
            if name.endswith(locks.OWNER_SUFFIX) and _orphan(record, now=time.time() if now is None else now):
                if not dry_run:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(record)
                report.orphan_records.append(str(record))
    return report


def _orphan(record: Path, *, now: float) -> bool:
    """A record whose lock is gone (its holder died between the two unlinks of a release). A lock is created
    before its record, so a record younger than a minute may belong to a lock listed after our scan."""
    try:
        young = now - os.lstat(record).st_mtime < 60.0
    except FileNotFoundError:
        return False
    return not young and not os.path.lexists(str(record)[: -len(locks.OWNER_SUFFIX)])


def _launcher_root_of(part: Path) -> Path | None:
    """The launcher root `part` is a compiler folder of (`<root>/neuron`, `<root>/inductor`...), if it is one: its
    fingerprints promise what was just pruned from `part` too."""
    if part.name in LAUNCHER_LAYOUT and (part.parent / fingerprint.MARKER_DIR).is_dir():
        return part.parent
    return None
