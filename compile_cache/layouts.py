"""List, publish, sync and verify a cache root of any of the three layouts (paths.Layout).

- `neuron`: Neuron's `neuronxcc-*/MODULE_*` entries, shared whole (store.py);
- `tree`: a plain tree of files such as Inductor's or Triton's cache, shared file by file (tree.py);
- `launcher`: the root megatron-hpc gives a job, one folder per compiler (paths.LAUNCHER_LAYOUT). This is what
  the node script syncs before a phase and publishes after it. A folder missing from the source, or a missing
  source root (no compile phase ever published), is an empty cache: nothing to copy.

`entries` gives every layout's entries one shape, for `cache ls` and `cache prune`; in a launcher root their keys
start with the compiler's folder (`neuron/neuronxcc-.../MODULE_...`, `inductor/fxgraph/...`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron_hpc.compile_cache import fingerprint, locks, neuron, report, store, tree
from megatron_hpc.compile_cache.paths import LAUNCHER_LAYOUT, Layout


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """One entry of any layout: a Neuron MODULE_ directory, or a tree file (or group folder)."""

    key: str
    """Relative to the root given; in a launcher root it starts with the compiler's folder."""
    state: str
    """A neuron.State value; tree entries are always complete (only whole files are ever visible)."""
    size: int
    last_used: float
    files: tuple[str, ...]
    part_root: Path
    """The root of the entry's own layout (a launcher root's neuron/ or inductor/ folder)."""
    item: neuron.Entry | tree.TreeEntry

    def remove(self) -> int:
        """Make the entry vanish (store.remove_entry, tree.remove_entry). Bytes freed."""
        if isinstance(self.item, neuron.Entry):
            return store.remove_entry(self.item, root=self.part_root)
        return tree.remove_entry(self.item, root=self.part_root)


def parts(root: Path, *, layout: Layout) -> list[tuple[str, Path, Layout]]:
    """(folder, its path, its layout) for each single-layout part of `root`; a launcher root's folders that are
    real directories ("" for a root that is one layout itself)."""
    if layout != "launcher":
        return [("", root, layout)]
    return [(folder, root / folder, sub) for folder, sub in LAUNCHER_LAYOUT.items()
            if (root / folder).is_dir() and not (root / folder).is_symlink()]


def entries(root: Path, *, layout: Layout) -> Iterator[Entry]:
    """Every entry under `root`, never following a symlink."""
    for folder, part_root, sub in parts(root, layout=layout):
        prefix = f"{folder}/" if folder else ""
        if sub == "neuron":
            for e in neuron.scan(part_root):
                yield Entry(key=prefix + e.key, state=e.state.value, size=e.size, last_used=e.last_used,
                            files=e.files, part_root=part_root, item=e)
        else:
            for t in tree.scan(part_root):
                yield Entry(key=prefix + t.key, state=neuron.State.COMPLETE.value, size=t.size,
                            last_used=t.last_used, files=t.files, part_root=part_root, item=t)


def clean_leftovers(root: Path, *, layout: Layout, older_than: float = store.DEFAULT_LEFTOVER_AGE_S,
                    now: float | None = None, dry_run: bool = False) -> list[Path]:
    """Temp files and folders of killed publishers and pruners, in each part of `root` (store/tree.clean_leftovers)."""
    removed: list[Path] = []
    for _folder, part_root, sub in parts(root, layout=layout):
        clean = store.clean_leftovers if sub == "neuron" else tree.clean_leftovers
        removed += clean(part_root, older_than=older_than, now=now, dry_run=dry_run)
    return removed


def stats(root: Path, *, layout: Layout) -> dict:
    """`cache stats` as JSON: report.stats for Neuron, report.tree_stats for trees, both for a launcher root."""
    if layout == "neuron":
        return {"layout": "neuron", **report.stats(root).to_json()}
    if layout == "tree":
        return {"layout": "tree", **report.tree_stats(root).to_json()}
    found = {folder: stats(path, layout=sub) for folder, path, sub in parts(root, layout=layout)}
    markers = root / fingerprint.MARKER_DIR
    return {"layout": "launcher", "root": str(root), "entries": sum(p["entries"] for p in found.values()),
            "bytes": sum(p["bytes"] for p in found.values()), "parts": found,
            "fingerprints": len(list(markers.glob("*.json"))) if markers.is_dir() and not markers.is_symlink() else 0}


def transfer(src_root: Path, dst_root: Path, *, layout: Layout,
             group_writable: bool = False) -> dict[str, store.TransferReport]:
    """Copy what `dst_root` lacks from `src_root`; one report per folder of the layout ("" for the root itself)."""
    if layout == "neuron":
        return {"": store.transfer(src_root, dst_root, group_writable=group_writable)}
    if layout == "tree":
        return {"": tree.transfer(src_root, dst_root, group_writable=group_writable)}
    reports = {}
    for folder, part_root, sub_layout in parts(src_root, layout=layout):
        (part,) = transfer(part_root, dst_root / folder, layout=sub_layout, group_writable=group_writable).values()
        reports[folder] = part
    return reports


def verify(root: Path, *, layout: Layout, stale_after: float = locks.DEFAULT_STALE_AFTER_S,
           leftover_age: float = store.DEFAULT_LEFTOVER_AGE_S, dry_run: bool = False) -> report.VerifyReport:
    """report.verify for Neuron folders; for trees, old temp files of dead publishers, unshareable files and
    group files naming files their folder lacks."""
    if layout == "neuron":
        return report.verify(root, stale_after=stale_after, leftover_age=leftover_age, dry_run=dry_run)
    if layout == "tree":
        result = report.VerifyReport(root=str(root))
        result.leftovers_removed = [str(p) for p in tree.clean_leftovers(root, older_than=leftover_age,
                                                                         dry_run=dry_run)]
        walked = tree.walk(root)
        result.entries = sum(len(f.files) for f in walked.folders)
        result.problems = [report.Problem(path=str(root / rel), what="not a regular file or directory",
                                          fix="remove it: compilers write regular files only, so it is never shared")
                           for rel in walked.refused]
        result.problems += _group_problems(root, walked)
        return result
    combined = report.VerifyReport(root=str(root))
    for _folder, part_root, sub_layout in parts(root, layout=layout):
        part = verify(part_root, layout=sub_layout, stale_after=stale_after, leftover_age=leftover_age,
                      dry_run=dry_run)
        combined.entries += part.entries
        combined.problems += part.problems
        combined.leftovers_removed += part.leftovers_removed
    return combined


def _group_problems(root: Path, walked: tree.Walk) -> list[report.Problem]:
    """Triton group files (`__grp__*.json`, {"child_paths": {name: path}}) must name files of their own folder."""
    found = []
    for folder in walked.folders:
        present = set(folder.files)
        for name in (n for n in folder.files if n.startswith(tree.GROUP_PREFIX)):
            path = root / folder.rel / name
            try:
                children = json.loads(path.read_bytes()).get("child_paths", {})
                missing = sorted(str(name) for name in children if name not in present)
            except (OSError, ValueError, AttributeError):
                found.append(report.Problem(path=str(path), what="unreadable group file",
                                            fix=f"remove the folder {root / folder.rel}; it is compiled again"))
                continue
            if missing:
                found.append(report.Problem(path=str(path), what=f"group names files its folder lacks: "
                                            f"{', '.join(missing)}",
                                            fix=f"remove the folder {root / folder.rel}; it is compiled again"))
    return found
