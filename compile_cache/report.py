"""Read-only views of a cache: `stats` (counts, sizes, versions) and `verify` (what is wrong and how to fix it).

`stats` must stay fast on large shared caches (100,000 entries in under 2 s, benchmarks/cache_stats.py): one
directory listing per directory and one lstat per file, the same work as `du -s`, and little Python per entry.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_hpc.compile_cache import locks, neuron, store, tree


@dataclass(kw_only=True, slots=True)
class VersionStats:
    counts: dict[str, int] = field(default_factory=lambda: {s.value: 0 for s in neuron.State})
    bytes: int = 0


@dataclass(kw_only=True, slots=True)
class Stats:
    root: str
    versions: dict[str, VersionStats] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        total = {s.value: 0 for s in neuron.State}
        for v in self.versions.values():
            for k, n in v.counts.items():
                total[k] += n
        return total

    @property
    def num_entries(self) -> int:
        return sum(self.counts.values())

    @property
    def bytes(self) -> int:
        return sum(v.bytes for v in self.versions.values())

    def to_json(self) -> dict:
        return {"root": self.root, "entries": self.num_entries, "bytes": self.bytes, "counts": self.counts,
                "versions": {k: {"counts": v.counts, "bytes": v.bytes} for k, v in sorted(self.versions.items())}}


def stats(root: Path) -> Stats:
    """Counts per state and apparent sizes, per compiler version."""
    result = Stats(root=str(root))
    for v in neuron.iter_version_dirs(root):
        vs = result.versions.setdefault(v.name[len(neuron.VERSION_PREFIX):], VersionStats())
        # An entry's state depends only on its file names, and a cache holds few distinct name sets: count
        # the sets, classify each once. Per entry there is then nothing left but the syscalls `du` makes too.
        by_names: dict[frozenset[str], int] = {}
        for path in [e.path for e in neuron.iter_entry_dirs(v.path)]:
            prefix = path + os.sep
            try:
                names = os.listdir(path)  # a real directory (scandir's d_type said so): nothing is followed
                vs.bytes += sum([os.lstat(prefix + name).st_size for name in names])
            except FileNotFoundError:  # pruned meanwhile
                continue
            key = frozenset(names)
            by_names[key] = by_names.get(key, 0) + 1
        for names_, n in by_names.items():
            vs.counts[neuron.classify(set(names_)).value] += n
    return result


BUCKETS = "??"
"""Inductor's two-character bucket folders (generated code, kernels), counted together by tree_stats."""


@dataclass(kw_only=True, slots=True)
class FolderStats:
    entries: int = 0
    bytes: int = 0


@dataclass(kw_only=True, slots=True)
class TreeStats:
    root: str
    folders: dict[str, FolderStats] = field(default_factory=dict)
    """Per top-level folder (`fxgraph`, `aotautograd`, ...; BUCKETS for Inductor's buckets; `.` for the root)."""

    @property
    def num_entries(self) -> int:
        return sum(f.entries for f in self.folders.values())

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.folders.values())

    def to_json(self) -> dict:
        return {"root": self.root, "entries": self.num_entries, "bytes": self.bytes,
                "folders": {k: {"entries": v.entries, "bytes": v.bytes} for k, v in sorted(self.folders.items())}}


def tree_stats(root: Path) -> TreeStats:
    """Entries (tree.scan) and apparent sizes of a plain-tree cache, per top-level folder."""
    result = TreeStats(root=str(root))
    for entry in tree.scan(root):
        top = entry.key.split("/", 1)[0] if "/" in entry.key else "."
        fs = result.folders.setdefault(BUCKETS if len(top) == 2 else top, FolderStats())
        fs.entries += 1
        fs.bytes += entry.size
    return result


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    path: str
    what: str
    fix: str


@dataclass(kw_only=True, slots=True)
class VerifyReport:
    root: str
    problems: list[Problem] = field(default_factory=list)
    leftovers_removed: list[str] = field(default_factory=list)
    entries: int = 0


def verify(root: Path, *, stale_after: float = locks.DEFAULT_STALE_AFTER_S,
           leftover_age: float = store.DEFAULT_LEFTOVER_AGE_S, dry_run: bool = False) -> VerifyReport:
    """Check every entry; remove old temp dirs of killed publishers (unless `dry_run`); list the rest."""
    report = VerifyReport(root=str(root))
    report.leftovers_removed = [str(p) for p in store.clean_leftovers(root, older_than=leftover_age,
                                                                      dry_run=dry_run)]
    now = time.time()
    old_layout = root / neuron.OLD_LAYOUT_SUBDIR
    if old_layout.is_dir() and any(True for _ in neuron.iter_version_dirs(old_layout)):
        report.problems.append(Problem(path=str(old_layout), what="entries in the old nested layout",
                                       fix=f"older libneuronxla wrote these; inspect them with --root {old_layout}"))
    for link in _symlinks(root):
        report.problems.append(Problem(path=link, what="symlink inside the cache (never followed)",
                                       fix="replace it with a real directory or remove it"))
    for entry in neuron.scan(root):
        report.entries += 1
        report.problems += _entry_problems(entry, root=root, stale_after=stale_after, now=now)
    return report


def _entry_problems(entry: neuron.Entry, *, root: Path, stale_after: float, now: float) -> list[Problem]:
    p = str(entry.path)
    found = []
    if entry.graph_hash is None:
        found.append(Problem(path=p, what="name is not MODULE_<graph hash>+<flags hash>",
                             fix="not written by neuronx-cc; remove it if nothing of yours uses it"))
    if entry.state is neuron.State.COMPLETE and os.lstat(entry.path / neuron.NEFF).st_size == 0:
        found.append(Problem(path=p, what="complete entry with an empty model.neff",
                             fix="remove the entry (`cache prune` or rm -r) so it is compiled again"))
    if entry.state is neuron.State.FAILED:
        found.append(Problem(path=p, what="cached compile failure: blocks recompiling this graph",
                             fix=f"read model.log, then `megatron-hpc cache clear-failed --root {root}` or set "
                                 "--retry_failed_compilation in NEURON_CC_FLAGS"))
    for name in entry.locks:
        status = locks.lock_status(entry.path / name, stale_after=stale_after, now=now)
        if status.stale:
            found.append(Problem(path=str(status.path), what=f"stale lock ({status.reason})",
                                 fix=f"`megatron-hpc cache clear-locks --root {root}`, else every run needing it "
                                     "waits forever"))
    if neuron.NEFF in entry.files and neuron.DONE not in entry.files and not entry.locks:
        found.append(Problem(path=p, what="model.neff without model.done: the compile was interrupted",
                             fix="remove the entry so it is compiled again"))
    return found


def _symlinks(root: Path) -> list[str]:
    found = []
    for v in os.scandir(root) if root.is_dir() else ():
        if v.is_symlink():
            found.append(v.path)
        elif v.name.startswith(neuron.VERSION_PREFIX) and v.is_dir(follow_symlinks=False):
            found += [e.path for e in os.scandir(v.path) if e.is_symlink()]
    return found
