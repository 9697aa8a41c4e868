"""`megatron-hpc debug RUN`: Python stacks of every rank of a running job, in one report."""

from __future__ import annotations

import argparse
import json

from megatron_hpc.launch.debug_run import debug_run, format_report
from megatron_hpc.launch.run_status import find_run_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run folder or job id")
    parser.add_argument("--method", choices=("auto", "py-spy", "signal"), default="auto",
                        help="py-spy dump (auto when py-spy is on PATH), or SIGUSR1 to the trainer's faulthandler")
    parser.add_argument("--timeout", type=float, default=20.0, metavar="SECONDS",
                        help="how long to wait for each rank's stacks (default 20)")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


def run(args: argparse.Namespace) -> int:
    report = debug_run(find_run_dir(args.run), method=args.method, timeout_s=args.timeout)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(format_report(report), end="")
        print(f"\nreport written to {report.report_file}")
    return 0 if report.ranks and not report.missing else 1
