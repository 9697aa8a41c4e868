"""Arguments shared by `plan` and `submit`, and turning them into a config and a plan.

Building the parsers imports no more than the platform table: the loader and the planner load when a command
runs, and numpy only where data files are read (tests/unit/test_cli_startup.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_hpc.config.platforms import PLATFORMS, Platform, resolve_platform

if TYPE_CHECKING:
    from megatron_hpc.config.schema import RunConfig
    from megatron_hpc.plan.calibration import Calibration
    from megatron_hpc.plan.planner import Plan
    from megatron_hpc.plan.spec import RunSpec


def add_recipe_arguments(parser: argparse.ArgumentParser, *, recipe_required: bool = True) -> None:
    parser.add_argument("--recipe", required=recipe_required, help="recipe name (e.g. tiny, gpt3_6.7b) or a YAML path")
    parser.add_argument("--nodes", type=int, default=None, help="number of nodes (default 1)")
    parser.add_argument("--platform", default=None, metavar="NAME",
                        help=f"hardware of the nodes: {', '.join(sorted(PLATFORMS))}, or one of the cluster "
                             "profile's platforms (default: the recipe's launch.platform)")
    parser.add_argument("--platform-file", type=Path, metavar="FILE", default=None,
                        help="a YAML file describing the nodes' hardware (peak FLOP/s, memory, links) and the built-in "
                             "platform they run as; instead of --platform (docs/planning.md#platform-files)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set train.num_steps=100 (repeatable)")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


@dataclass(frozen=True, kw_only=True, slots=True)
class Resolved:
    cfg: RunConfig
    platform: Platform
    plan: Plan
    calibration_note: str | None = None
    """Why a calibration kept by `tune` was not used (stale or foreign), for a warning; None otherwise."""

    @property
    def spec(self) -> RunSpec:
        from megatron_hpc.plan.spec import RunSpec

        return RunSpec(config=self.cfg, plan=self.plan)


def chosen_platform(args: argparse.Namespace, *, default: str) -> Platform:
    """--platform-file's hardware on its runtime, else --platform, else the recipe's launch.platform."""
    path = getattr(args, "platform_file", None)
    if path is None and args.platform and args.platform not in PLATFORMS:
        return _profile_platform(args)
    if path is None:
        return resolve_platform(args.platform, default=default)
    from megatron_hpc.config.hardware import load_platform_file
    from megatron_hpc.config.platforms import with_hardware
    from megatron_hpc.errors import ConfigError

    if args.platform:
        raise ConfigError(f"--platform {args.platform} and --platform-file {path} both name the hardware; use one "
                          "(the file's runtime key says which built-in platform its nodes run as)")
    return with_hardware(load_platform_file(path, runtimes=tuple(sorted(PLATFORMS))))


def _profile_platform(args: argparse.Namespace) -> Platform:
    """--platform NAME from the `platforms:` of the cluster profile (--cluster-config, else the default one)."""
    from megatron_hpc.config.platforms import with_hardware
    from megatron_hpc.errors import ConfigError
    from megatron_hpc.launch.cluster_profile import find_profile

    loaded = find_profile(getattr(args, "cluster_config", None))
    found = {hw.name: hw for hw in loaded.profile.platforms}
    if args.platform in found:
        return with_hardware(found[args.platform])
    if found:
        own = f", or of the cluster profile {loaded.path}: {', '.join(found)}"
    else:
        own = f" (the cluster profile {loaded.path} describes none)" if loaded.path else " (no cluster profile found)"
    raise ConfigError(f"unknown platform {args.platform!r}; use one of {', '.join(sorted(PLATFORMS))}{own}, or "
                      "describe the nodes with --platform-file FILE")


def resolve(args: argparse.Namespace) -> Resolved:
    """The recipe with its overrides, planned for --nodes of --platform (the plan records the platform: the
    config keeps the recipe's launch.platform as its default, never the flag)."""
    from megatron_hpc.config.loader import load_recipe
    from megatron_hpc.plan.planner import make_plan

    cfg = load_recipe(args.recipe, list(args.overrides))
    platform = chosen_platform(args, default=cfg.launch.platform)
    nodes = 1 if args.nodes is None else args.nodes
    plan = make_plan(cfg, num_nodes=nodes, platform=platform)
    calibration, note = measured_calibration(plan)
    if calibration is not None:
        plan = make_plan(cfg, num_nodes=nodes, platform=platform, calibration=calibration)
    return Resolved(cfg=cfg, platform=platform, plan=plan, calibration_note=note)


def measured_calibration(plan: Plan) -> tuple[Calibration | None, str | None]:
    """The calibration `tune` kept for the plan's hardware in the shared cache, when it may be used; else None and
    the one line that says why not (None when tune never ran for this hardware)."""
    import time

    from megatron_hpc.compile_cache import calibrations
    from megatron_hpc.compile_cache.paths import default_cache_root

    stored = calibrations.find(default_cache_root(), plan.hardware)
    if stored is None:
        return None, None
    now = time.time()
    problem = calibrations.usable(stored, hardware=plan.hardware, now_s=now, runtime=plan.platform,
                                  workers_per_node=plan.workers_per_node + plan.idle_workers_per_node,
                                  versions=calibrations.software_versions())
    if problem is not None:
        return None, problem
    return calibrations.labelled(stored, now_s=now), None
