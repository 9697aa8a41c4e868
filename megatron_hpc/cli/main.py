"""Entry point of the `megatron-hpc` command.

An ordered registry maps each command to its module and a one-line summary; only the chosen
command's module is imported, so `--help` and `plan` never import torch. Each command module
exposes `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from megatron_hpc import __version__
from megatron_hpc.errors import MegatronHpcError, access_problem

COMMANDS: dict[str, tuple[str, str]] = {
    "submit": ("megatron_hpc.cli.submit_cmd", "plan, write and queue the compile and run phases"),
    "plan": ("megatron_hpc.cli.plan_cmd", "check a recipe against a cluster and print the mesh, batch and memory"),
    "tune": ("megatron_hpc.cli.tune_cmd", "run the best predicted layouts briefly, calibrate the step-time model, "
                                          "pick the fastest"),
    "status": ("megatron_hpc.cli.status_cmd", "phase, SLURM state, requeues and progress of a run"),
    "logs": ("megatron_hpc.cli.logs_cmd", "print (or follow) a node's log of a run"),
    "cancel": ("megatron_hpc.cli.cancel_cmd", "cancel both phases of a run"),
    "restart": ("megatron_hpc.cli.restart_cmd", "move a running run with hot spares off some nodes, in its job"),
    "runs": ("megatron_hpc.cli.runs_cmd", "table of recent runs"),
    "debug": ("megatron_hpc.cli.debug_cmd", "collect the Python stacks of every rank of a running job"),
    "report": ("megatron_hpc.cli.report_cmd", "plot loss, learning rate and throughput of a run"),
    "cache": ("megatron_hpc.cli.cache_cmd", "inspect, verify, prune and share the compile cache"),
    "train": ("megatron_hpc.cli.train_cmd", "per-rank training entry point (what torchrun starts)"),
    "ckpt": ("megatron_hpc.cli.ckpt_cmd", "inspect checkpoints"),
    "generate": ("megatron_hpc.cli.generate_cmd", "continue prompts with a checkpoint (greedy or sampled, CPU)"),
    "evaluate": ("megatron_hpc.cli.evaluate_cmd", "valid/test split loss, zero-shot WikiText and LAMBADA (CPU)"),
    "serve": ("megatron_hpc.cli.serve_cmd", "serve Megatron's text generation API (PUT /api) on a checkpoint"),
    "data": ("megatron_hpc.cli.data_cmd", "preprocess, inspect and sample Megatron .bin/.idx datasets"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The whole parser for the command line `argv`: every subcommand's name, and the arguments of the one `argv`
    selects (the others' modules are not imported, so `--help` and `plan` start without torch)."""
    selected = _selected_command(argv)
    parser = argparse.ArgumentParser(
        prog="megatron-hpc",
        description="Plan, launch and train Megatron-style GPT runs on SLURM (Trainium, CUDA, CPU).",
    )
    parser.add_argument("--version", action="version", version=f"megatron-hpc {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, summary) in COMMANDS.items():
        cmd = sub.add_parser(name, help=summary, description=summary)
        cmd.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show tracebacks of errors")
        if name == selected:
            importlib.import_module(module).add_arguments(cmd)
    return parser


def _selected_command(argv: list[str]) -> str | None:
    for token in argv:
        if not token.startswith("-"):
            return token if token in COMMANDS else None
    return None


def _say_error(line: str) -> None:
    """The error line on stderr; under torchrun once per node, not once per local rank (cli/said_once.py)."""
    from megatron_hpc.cli.said_once import first_to_say

    if first_to_say(line):
        print(line, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except MegatronHpcError as exc:
        if getattr(args, "debug", False):
            traceback.print_exc()
        _say_error(f"megatron-hpc: error: {exc}")
        return 1
    except PermissionError as exc:
        # What the commands do not word themselves (a file written, a folder listed): still one line, naming it
        if getattr(args, "debug", False):
            traceback.print_exc()
        where = f"{exc.filename}: {access_problem(exc.filename, exc)}" if exc.filename else str(exc)
        _say_error(f"megatron-hpc: error: {where}; change its permissions (chmod, or ask its owner) or run as a "
                   "user who may use it")
        return 1
    except KeyboardInterrupt:
        print("megatron-hpc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader (`| head`) went away; say nothing more and do not flush into the closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    # `python -m megatron_hpc.cli.main ...` (the entry point's module, as some launch wrappers name it) runs the CLI
    # too, instead of importing it and exiting 0 having done nothing.
    sys.exit(main())
