"""Publish, sync and verify a cache root of any of the three layouts (paths.Layout).

- `neuron`: Neuron's `neuronxcc-*/MODULE_*` entries, shared whole (store.py);
- `tree`: a plain tree of files such as Inductor's or Triton's cache, shared file by file (tree.py);
- `launcher`: the root megatron-hpc gives a job, one folder per compiler (paths.LAUNCHER_LAYOUT). This is what
  the node script syncs before a phase and publishes after it. A folder missing from the source, or a missing
  source root (no compile phase ever published), is an empty cache: nothing to copy.
"""

from __future__ import annotations

from pathlib import Path

from megatron_hpc.compile_cache import locks, report, store, tree
from megatron_hpc.compile_cache.paths import LAUNCHER_LAYOUT, Layout


def transfer(src_root: Path, dst_root: Path, *, layout: Layout,
             group_writable: bool = False) -> dict[str, store.TransferReport]:
    """Copy what `dst_root` lacks from `src_root`; one report per folder of the layout ("" for the root itself)."""
    if layout == "neuron":
        return {"": store.transfer(src_root, dst_root, group_writable=group_writable)}
    if layout == "tree":
        return {"": tree.transfer(src_root, dst_root, group_writable=group_writable)}
    reports = {}
    for folder, sub_layout in LAUNCHER_LAYOUT.items():
        if (src_root / folder).is_dir() and not (src_root / folder).is_symlink():
            (part,) = transfer(src_root / folder, dst_root / folder, layout=sub_layout,
                               group_writable=group_writable).values()
            reports[folder] = part
    return reports


def verify(root: Path, *, layout: Layout, stale_after: float = locks.DEFAULT_STALE_AFTER_S,
           leftover_age: float = store.DEFAULT_LEFTOVER_AGE_S, dry_run: bool = False) -> report.VerifyReport:
    """report.verify for Neuron folders; for trees, old temp files of dead publishers and unshareable files."""
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
        return result
    combined = report.VerifyReport(root=str(root))
    for folder, sub_layout in LAUNCHER_LAYOUT.items():
        if (root / folder).is_dir():
            part = verify(root / folder, layout=sub_layout, stale_after=stale_after, leftover_age=leftover_age,
                          dry_run=dry_run)
            combined.entries += part.entries
            combined.problems += part.problems
            combined.leftovers_removed += part.leftovers_removed
    return combined
