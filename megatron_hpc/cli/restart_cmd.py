"""`megatron-hpc restart RUN --exclude NODE`: move a running run with hot spares off some nodes, in its job."""

from __future__ import annotations

import argparse
import json

from megatron_hpc.launch.restart_request import request_restart
from megatron_hpc.launch.run_status import find_run_dir, read_status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run folder or job id")
    parser.add_argument("--exclude", action="append", required=True, metavar="NODE",
                        help="a node to leave out of the next step (repeat for more)")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


def run(args: argparse.Namespace) -> int:
    status = read_status(find_run_dir(args.run))
    request = request_restart(status, args.exclude)
    if args.json:
        print(json.dumps({"run_dir": status.run_dir, "job_id": request.job_id, "exclude": request.exclude}))
    else:
        print(f"asked job {request.job_id} to restart without {', '.join(request.exclude)}: its workers save at "
              "the next step, then a new step starts on the other nodes (`megatron-hpc status` shows it)")
    return 0
