"""Whether a SLURM partition's nodes are the platform a tune job would calibrate, from `sinfo`'s text. Pure.

`megatron-hpc tune` keeps what it measures under the platform's name (compile_cache/calibrations.py), so a job on
other nodes would file wrong figures. The trainer checks its own node once the job runs (train/tune_trials.py,
CUDA only: torch says how many devices and how much memory); this check runs before anything is queued, on what
the controller reports of each node of the partition (launch/tune_job.py runs `sinfo -h -N -o SINFO_FORMAT`):

- GPU platforms (Platform.gpus_per_node > 0): the GPUs of the node's GRES must be the platform's count, and the
  node needs a CPU per worker;
- Trainium (XLA): a node whose GRES lists GPUs is not a Trainium node, and it needs a CPU per worker;
- the CPU platform: nothing (its workers are processes that may share cores, and its memory is nominal).

The device memory a platform states is not in sinfo (its memory column, %m, is the node's RAM); the trainer's
check compares it on CUDA once the job runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_hpc.config.platforms import Platform

SINFO_FORMAT = "%N|%P|%c|%m|%G|%f"
"""Node name, partition (the default one marked with *), CPUs, memory in MB, GRES, features: one line per node and
partition."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeShape:
    """What sinfo reports of one node."""

    name: str
    cpus: int
    memory_mb: int
    gres: str
    """As sinfo prints it: gpu:8, gpu:h100:8(S:0-1), several comma-separated, or (null)."""
    features: tuple[str, ...] = ()

    @property
    def gpus(self) -> int:
        return gres_gpus(self.gres)


def gres_gpus(gres: str) -> int:
    """GPUs a GRES string names: the count of each gpu entry (gpu:N or gpu:TYPE:N, a socket suffix ignored)."""
    total = 0
    for entry in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = entry.strip().split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def partition_nodes(text: str, partition: str | None, *, constraint: str | None = None) -> tuple[list[NodeShape], str]:
    """The nodes of `partition` (the default one when None) in sinfo's SINFO_FORMAT text that a job with
    `constraint` may get (a single feature name; a constraint expression keeps every node), and the partition's
    name. Lines that do not parse are skipped (sinfo's own warnings)."""
    by_partition: dict[str, list[NodeShape]] = {}
    default = None
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 6 or not fields[2].isdigit():
            continue
        name, part, cpus, memory, gres, features = fields
        if part.endswith("*"):
            part = default = part[:-1]
        node = NodeShape(name=name, cpus=int(cpus), memory_mb=int(memory) if memory.isdigit() else 0, gres=gres,
                         features=tuple(f for f in features.split(",") if f and f != "(null)"))
        by_partition.setdefault(part, []).append(node)
    chosen = partition or default or ""
    nodes = by_partition.get(chosen, [])
    if constraint and re.fullmatch(r"[\w.-]+", constraint):
        nodes = [n for n in nodes if constraint in n.features]
    return nodes, chosen or "(default)"


def _differs(node: NodeShape, platform: Platform, workers: int) -> str | None:
    """How this node differs from the platform, or None."""
    if platform.gpus_per_node:
        if node.gpus != platform.gpus_per_node:
            return f"{node.gpus} GPUs (GRES {node.gres})"
    elif platform.backend == "xla" and node.gpus:
        return f"{node.gpus} GPUs (GRES {node.gres}), not Trainium devices"
    if platform.backend != "gloo" and node.cpus < workers:
        return f"{node.cpus} CPUs for {workers} workers"
    return None


def node_shape_mismatch(nodes: list[NodeShape], *, partition: str, platform: Platform, hardware: str,
                        workers_per_node: int) -> str | None:
    """Why the partition's nodes are not the platform's (the first node that differs, and how many do), with the
    fix; None when every node matches or sinfo listed none (the job's own check still runs)."""
    differing = [(node, what) for node in nodes if (what := _differs(node, platform, workers_per_node))]
    if not differing:
        return None
    node, what = differing[0]
    some = f"{len(differing)} of its {len(nodes)} nodes" if len(differing) < len(nodes) else "its nodes"
    states = (f"{platform.gpus_per_node} GPUs and {workers_per_node} workers per node" if platform.gpus_per_node
              else f"{workers_per_node} workers per node on {platform.name} devices")
    describe = (f"describe these with --platform-file (workers_per_node: {node.gpus})" if node.gpus
                else "use a platform file that describes them (--platform-file)")
    return (f"tune would run on partition {partition}, but sinfo reports {some} unlike platform {hardware} "
            f"({node.name}: {what}; {hardware} states {states}), and a calibration measured there would be kept "
            f"under {hardware}'s name; use --partition (or the profile's constraint) with the platform's nodes, or "
            f"{describe}; nothing was queued")
