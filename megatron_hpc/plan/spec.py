"""RunSpec: the resolved config and the plan made from it, the trainer's only input. Pure.

A run folder keeps the two halves as config.json and plan.json (megatron_hpc/run_folder.py reads and writes
them); the plan records the digest of the config it was made from, so a config edited after planning is
refused instead of being trained with the old plan's mesh, batch or vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_hpc.config.loader import from_dict
from megatron_hpc.config.platforms import Platform
from megatron_hpc.config.schema import RunConfig
from megatron_hpc.errors import PlanError
from megatron_hpc.plan.planner import Plan, config_digest, make_plan


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    config: RunConfig
    plan: Plan

    def config_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self.config)

    @classmethod
    def from_json(cls, config: dict[str, Any], plan: dict[str, Any], *, where: str = "the run folder") -> RunSpec:
        """Both halves checked: the config's keys and types, the plan's consistency, and that they belong together."""
        cfg = from_dict(RunConfig, config)
        made = Plan.from_json(plan, source=f"{where}/plan.json")
        if made.config_sha256 != config_digest(dataclasses.asdict(cfg)):
            raise PlanError(f"{where}/config.json changed after {where}/plan.json was made from it; the trainer "
                            "reads its mesh, batch and vocabulary from the plan, so re-plan the run: "
                            "`megatron-hpc submit --resume RUN` (or submit the recipe again)")
        return cls(config=cfg, plan=made)


def plan_run(cfg: RunConfig, *, num_nodes: int, platform: Platform) -> RunSpec:
    """Plan `cfg` for `num_nodes` nodes of `platform` (make_plan) and pair them."""
    return RunSpec(config=cfg, plan=make_plan(cfg, num_nodes=num_nodes, platform=platform))
