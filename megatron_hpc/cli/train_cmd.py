"""`megatron-hpc train`: the per-rank entry point torchrun starts in every worker.

Either `--run-dir DIR` (the folder `submit` wrote, holding config.json) or `--recipe R [--set ...]`
for a direct `torchrun -m megatron_hpc train --recipe tiny` run. torch is imported only here.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from megatron_hpc.config.loader import from_dict, load_recipe
from megatron_hpc.config.schema import RunConfig
from megatron_hpc.debug_stacks import register_stack_dump
from megatron_hpc.errors import ConfigError, MegatronHpcError
from megatron_hpc.run_markers import FATAL_FILE, write_marker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run-dir", type=Path, help="run folder written by submit (reads config.json)")
    source.add_argument("--recipe", help="recipe name or YAML path")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key (with --recipe)")
    parser.add_argument("--phase", choices=("compile", "run"), default="run",
                        help="compile: the short trial run; run: the real run (default)")


def load_run_config(args: argparse.Namespace) -> RunConfig:
    if args.recipe:
        return load_recipe(args.recipe, args.overrides)
    if args.overrides:
        raise ConfigError("--set applies to --recipe; edit config.json of the run folder instead")
    path = args.run_dir / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} not found; is {args.run_dir} a run folder written by "
                          "`megatron-hpc submit`?") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); re-create the run folder with submit") from None
    return from_dict(RunConfig, data)


def run(args: argparse.Namespace) -> int:
    if args.run_dir is not None and args.run_dir.is_dir():
        # `megatron-hpc debug` asks for stacks with SIGUSR1 where py-spy is missing.
        register_stack_dump(args.run_dir, rank=int(os.environ.get("RANK", "0")))
    try:
        cfg = load_run_config(args)
        from megatron_hpc.train.entry import run_training

        return run_training(cfg, phase=args.phase, run_dir=args.run_dir)
    except MegatronHpcError as exc:
        # Our own errors (config, data, checkpoint, divergence) come back on a retry: tell the node
        # task not to requeue. Crashes and lost nodes leave no marker and are requeued.
        if args.run_dir is not None and args.run_dir.is_dir():
            write_marker(args.run_dir, FATAL_FILE, {"phase": args.phase, "error": str(exc)[:2000],
                                                    "kind": type(exc).__name__})
        raise
