"""`megatron-hpc train`: the per-rank entry point torchrun starts in every worker.

Either `--run-dir DIR` (the folder `submit` wrote: its config.json and plan.json are the run spec) or
`--recipe R [--set ...] [--platform P]` for a direct `torchrun -m megatron_hpc train --recipe tiny` run, planned
here for the world torchrun started. torch is imported only when training starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.platforms import PLATFORMS
from megatron_hpc.debug_stacks import register_stack_dump
from megatron_hpc.errors import ConfigError, MegatronHpcError
from megatron_hpc.plan.spec import RunSpec
from megatron_hpc.run_folder import read_spec
from megatron_hpc.run_markers import FatalMarker, write_record


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run-dir", type=Path, help="run folder written by submit (reads config.json and plan.json)")
    source.add_argument("--recipe", help="recipe name or YAML path (planned here for torchrun's world)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key (with --recipe)")
    parser.add_argument("--platform", choices=sorted(PLATFORMS), default=None,
                        help="with --recipe: the platform to plan for (default: the recipe's launch.platform)")
    parser.add_argument("--phase", choices=("compile", "run", "tune"), default="run",
                        help="compile: the short trial run; run: the real run (default); tune: the trials and "
                             "micro-benchmark of a `megatron-hpc tune` job (its run folder's tune-candidates.json)")


def load_run_spec(args: argparse.Namespace) -> RunSpec:
    """The run folder's spec, or the recipe planned for the world torchrun started."""
    if args.recipe:
        from megatron_hpc.train.entry import plan_for_torchrun

        return plan_for_torchrun(load_recipe(args.recipe, args.overrides), platform=args.platform)
    if args.overrides or args.platform:
        raise ConfigError("--set and --platform apply to --recipe; a run folder keeps its plan (re-plan it with "
                          "`megatron-hpc submit --resume RUN --set ...`)")
    return read_spec(args.run_dir)


def run(args: argparse.Namespace) -> int:
    if args.run_dir is not None and args.run_dir.is_dir():
        # `megatron-hpc debug` asks for stacks with SIGUSR1 where py-spy is missing.
        register_stack_dump(args.run_dir, rank=int(os.environ.get("RANK", "0")))
    try:
        if args.phase == "tune":
            if args.run_dir is None:
                raise ConfigError("--phase tune runs the trials a tune run folder lists; pass --run-dir RUN")
            from megatron_hpc.train.tune_trials import run_tune

            code = run_tune(args.run_dir)
        else:
            spec = load_run_spec(args)
            from megatron_hpc.train.entry import run_training

            code = run_training(spec, phase=args.phase, run_dir=args.run_dir)
    except Exception as exc:
        # Errors a retry cannot fix (our own: config, data, checkpoint, divergence; and the programming errors a
        # bad value provokes, such as a ValueError from torch) tell the node task not to requeue. Crashes, lost
        # peers and I/O errors leave no marker and are requeued.
        if args.run_dir is not None and args.run_dir.is_dir() and is_deterministic(exc):
            write_record(args.run_dir, FatalMarker(phase=args.phase, kind=type(exc).__name__,
                                                   error=describe(exc)[:2000]))
        raise
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        _exit_worker(code)
    return code


def _exit_worker(code: int) -> None:
    """End a torchrun worker whose run is finished and flushed, without the interpreter's teardown.

    Seen in this project's tests (2 of about 40 finished runs under load, always rank 0, after the last step
    and the process group's destruction): "terminate called without an active exception" and SIGABRT while
    the interpreter tears down torch's C++ objects, which hold threads (rank 0 also hosts the rendezvous
    TCPStore). A run that saved its checkpoint and logs must not end as a crash, which the node task would
    requeue; everything it wrote is closed by now (metrics, TensorBoard, checkpoints), so exit here.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_deterministic(exc: BaseException) -> bool:
    """Whether the same inputs would raise it again: our own errors and Python's value and type errors."""
    if isinstance(exc, MegatronHpcError):
        return True
    # RuntimeError covers lost peers and device faults (torch.distributed's errors derive from it), OSError a full
    # or flaky filesystem: both may pass on a retry. A ValueError or TypeError from our configuration will not.
    return isinstance(exc, (ValueError, TypeError, ZeroDivisionError, AssertionError, KeyError, IndexError,
                            AttributeError, NotImplementedError)) and not isinstance(exc, OSError)


def describe(exc: BaseException) -> str:
    """One line: ours as they are, others with their type (which says what kind of bug it is)."""
    return str(exc) if isinstance(exc, MegatronHpcError) else f"{type(exc).__name__}: {exc}"
