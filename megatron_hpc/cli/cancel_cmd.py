"""`megatron-hpc cancel RUN`: cancel both phases of a run."""

from __future__ import annotations

import argparse
import json

from megatron_hpc.launch.run_status import cancel_run, find_run_dir, read_status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run folder or job id")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


def run(args: argparse.Namespace) -> int:
    status = read_status(find_run_dir(args.run))
    cancelled = cancel_run(status)
    if args.json:
        print(json.dumps({"run_dir": status.run_dir, "cancelled": cancelled}))
    elif cancelled:
        print(f"cancelled job(s) {', '.join(cancelled)} of {status.run_dir}")
    else:
        print(f"nothing to cancel: every job of {status.run_dir} has ended")
    return 0
