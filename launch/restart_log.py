"""restarts.jsonl and stragglers.json, as `status` reports them. No torch.

The in-job driver (launch/in_job.py) appends a RestartRecord when it starts a step after a failed one, and a
second line, {"step", "first_step_done_at"}, once that step's trainer logged its first iteration: a restart's
cost is from the failure to then (detection, teardown, the new step's start, the checkpoint load and the
first step). stragglers.json is written by the trainer's last rank (issue 28, part 3).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_hpc.run_folder import RESTARTS_FILE, STRAGGLERS_FILE, read_json


@dataclass(frozen=True, kw_only=True, slots=True)
class RestartRecord:
    """One restart line of restarts.jsonl."""

    step: int
    """The new step's number in its job attempt."""
    reason: str
    """node_lost, rank_failed, hang or requested (launch/restart_rules.py)."""
    nodes_lost: list[str]
    nodes: list[str]
    """The new step's nodes."""
    failed_at: float
    detected_at: float
    new_step_started_at: float
    job_id: str | None = None
    attempt: int = 0


@dataclass(kw_only=True, slots=True)
class Restart:
    """A restart as `status --json` lists it."""

    job_id: str | None
    attempt: int
    step: int
    reason: str
    nodes_lost: list[str]
    nodes: list[str]
    failed_at: float
    cost_s: float | None = None
    """From the failure to the first iteration the new step logged; None while it has not logged one."""
    breakdown_s: dict[str, float] = field(default_factory=dict)
    """detection (failure -> the driver saw the step end), restart (-> the new step started) and
    first_step (-> its first logged iteration: process start, checkpoint load and the step)."""


def read_restarts(run_dir: Path) -> list[Restart]:
    """The restarts of a run, oldest first; [] when it has none (or no restarts.jsonl)."""
    try:
        lines = (run_dir / RESTARTS_FILE).read_text(errors="replace").splitlines()
    except OSError:
        return []
    found: dict[tuple[Any, Any, Any], Restart] = {}
    done: dict[tuple[Any, Any, Any], float] = {}
    for line in lines:
        try:
            data = json.loads(line)
            key = (data.get("job_id"), data.get("attempt", 0), int(data["step"]))
            if "first_step_done_at" in data:
                done[key] = float(data["first_step_done_at"])
                continue
            rec = RestartRecord(**data)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        found[key] = Restart(job_id=rec.job_id, attempt=rec.attempt, step=rec.step, reason=rec.reason,
                             nodes_lost=list(rec.nodes_lost), nodes=list(rec.nodes), failed_at=rec.failed_at,
                             breakdown_s={"detection": rec.detected_at - rec.failed_at,
                                          "restart": rec.new_step_started_at - rec.detected_at})
    for key, restart in found.items():
        if key in done:
            restart.cost_s = done[key] - restart.failed_at
            started = restart.failed_at + sum(restart.breakdown_s.values())
            restart.breakdown_s["first_step"] = done[key] - started
    return list(found.values())


def read_stragglers(run_dir: Path) -> list[dict[str, Any]]:
    """stragglers.json's nodes ({"node", "ratio", ...}); [] when none are named."""
    try:
        nodes = read_json(run_dir / STRAGGLERS_FILE).get("nodes") or []
    except (OSError, ValueError, AttributeError):
        return []
    return [n for n in nodes if isinstance(n, dict) and "node" in n]
