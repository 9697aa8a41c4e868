"""Checks of the submitting environment, before anything is queued. Pure apart from reading /proc/mounts.

- SLURM_* / SBATCH_* / SRUN_* variables leak into a job submitted from inside an allocation (sbatch and
  srun read them: SLURM_NTASKS, SLURM_CPU_BIND, SBATCH_PARTITION... change the new job). They are
  warned about and removed from what sbatch sees; SLURM_CONF, which only says where the cluster is, stays.
- A run folder on a node-local filesystem (/tmp, /var/tmp, /dev/shm, a tmpfs) cannot be seen by the
  other nodes of a multi-node job: their logs and checkpoints would be scattered or lost.
- A hard `ulimit -n` below launch.nofile_limit here usually means the same on the nodes.
"""

from __future__ import annotations

import resource
from collections.abc import MutableMapping
from pathlib import Path

_LEAK_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")
_KEEP = frozenset({"SLURM_CONF"})
NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
NODE_LOCAL_FS = frozenset({"tmpfs", "ramfs", "overlay"})


def leaked_slurm_vars(environ: MutableMapping[str, str]) -> list[str]:
    return sorted(k for k in environ if k.startswith(_LEAK_PREFIXES) and k not in _KEEP)


def remove_slurm_vars(environ: MutableMapping[str, str]) -> list[str]:
    """Drop the leaked variables from `environ` (os.environ before sbatch); returns their names."""
    names = leaked_slurm_vars(environ)
    for name in names:
        environ.pop(name, None)
    return names


def filesystem_type(path: Path, mounts: str | None = None) -> str | None:
    """The type of the filesystem holding `path`, from the longest matching mount point."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return None
    best, fstype = "", None
    target = str(path.resolve())
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, fields[2]
    return fstype


def node_local_reason(path: Path, mounts: str | None = None) -> str | None:
    """Why `path` is probably on one node's own disk, or None."""
    resolved = str(path.resolve())
    for local in NODE_LOCAL_DIRS:
        if resolved == local or resolved.startswith(local + "/"):
            return f"it is under {local}"
    fstype = filesystem_type(path, mounts)
    if fstype in NODE_LOCAL_FS:
        return f"it is on a {fstype} filesystem"
    return None


def submit_warnings(environ: MutableMapping[str, str], *, run_dir: Path, cluster: str, num_nodes: int,
                    nofile_limit: int, hard_nofile: int | None = None, mounts: str | None = None) -> list[str]:
    warnings = []
    leaked = leaked_slurm_vars(environ)
    if leaked and cluster == "slurm":
        shown = ", ".join(leaked[:6]) + (f" and {len(leaked) - 6} more" if len(leaked) > 6 else "")
        warnings.append(f"submitting from inside a SLURM allocation: {shown} would leak into the new jobs; "
                        "they are removed for sbatch")
    reason = node_local_reason(run_dir, mounts) if cluster == "slurm" and num_nodes > 1 else None
    if reason:
        warnings.append(f"the run folder {run_dir} looks node-local ({reason}): the other nodes cannot see it; "
                        "pass --out on a shared filesystem")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1] if hard_nofile is None else hard_nofile
    # Locally the node script itself says so when it cannot raise the limit.
    if cluster == "slurm" and hard != resource.RLIM_INFINITY and hard < nofile_limit:
        warnings.append(f"ulimit -n is capped at {hard} here (launch.nofile_limit is {nofile_limit}); if the "
                        "nodes are the same, collectives may run out of file descriptors at scale: ask your "
                        "admins to raise the hard limit")
    return warnings
