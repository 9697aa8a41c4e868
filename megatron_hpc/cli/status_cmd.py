"""`megatron-hpc status [RUN|JOBID]`: phases, SLURM state, requeues and training progress."""

from __future__ import annotations

import argparse
import json

from megatron_hpc.launch.run_status import find_run_dir, format_status, read_status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", nargs="?", help="run folder or job id (default: the most recent run)")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


def run(args: argparse.Namespace) -> int:
    status = read_status(find_run_dir(args.run))
    print(json.dumps(status.to_json(), indent=2) if args.json else format_status(status))
    return 0
