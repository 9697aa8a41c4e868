"""SLURM's view of a job's nodes: which it holds now and which SLURM reports unusable. No torch.

Under --no-kill SLURM keeps a job whose node failed and drops that node from the job's NodeList, so the live
`scontrol show job` (not the SLURM_JOB_NODELIST a batch script started with) is the allocation.
"""

from __future__ import annotations

import subprocess

from megatron_hpc.launch.requeue import job_fields
from megatron_hpc.launch.restart_rules import node_unusable


def _slurm(argv: list[str]) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def hostnames(nodelist: str) -> tuple[str, ...]:
    """`node[1-3]` -> (node1, node2, node3), by SLURM itself."""
    if not nodelist or nodelist == "(null)":
        return ()
    return tuple(_slurm(["scontrol", "show", "hostnames", nodelist]).split())


def allocation_nodes(job_id: str) -> tuple[str, ...]:
    """The job's nodes now (empty when SLURM does not know the job)."""
    return hostnames(job_fields(job_id).get("NodeList", ""))


def node_states(nodes: tuple[str, ...]) -> dict[str, str]:
    """NodeName -> State= of `scontrol show node` for these nodes ({} when scontrol does not answer)."""
    if not nodes:
        return {}
    states = {}
    for line in _slurm(["scontrol", "show", "node", "-o", ",".join(nodes)]).splitlines():
        fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        states[fields.get("NodeName", "")] = fields.get("State", "")
    return states


def unusable_nodes(nodes: tuple[str, ...]) -> frozenset[str]:
    """The nodes SLURM reports DOWN, DRAIN, FAIL or NOT_RESPONDING."""
    return frozenset(name for name, state in node_states(nodes).items() if node_unusable(state))
