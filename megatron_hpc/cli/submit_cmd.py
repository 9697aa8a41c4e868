"""`megatron-hpc submit`: plan, write the run folder, and queue the compile and run phases."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_hpc.cli.common import add_recipe_arguments, resolve
from megatron_hpc.cli.plan_cmd import format_plan
from megatron_hpc.launch.run_dir import default_run_dir, prepare_run_dir
from megatron_hpc.launch.scripts import SlurmOptions
from megatron_hpc.launch.submit import SubmitRequest, SubmitResult, check_cluster, submit, write_run_files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser)
    parser.add_argument("--cluster", choices=("slurm", "local"), default="slurm",
                        help="slurm (default) queues with sbatch; local runs both phases on this machine")
    parser.add_argument("--partition", help="SLURM partition")
    parser.add_argument("--account", help="SLURM account")
    parser.add_argument("--qos", help="SLURM quality of service")
    parser.add_argument("--exclude", help="SLURM nodes to avoid, e.g. node[3-4]")
    parser.add_argument("--time", type=int, metavar="MINUTES", help="time limit of each phase in minutes")
    parser.add_argument("--out", type=Path, help="run folder (default runs/<recipe>/<timestamp>)")
    parser.add_argument("--dry-run", action="store_true",
                        help="write config, plan, node script, compile.sbatch, run.sbatch and submit.sh; queue nothing")
    parser.add_argument("--wait", action="store_true", help="with --cluster slurm, follow the jobs until they end")
    parser.add_argument("--recompile", action="store_true",
                        help="run the compile phase even when the shared compile cache already holds this run's "
                             "fingerprint")


def run(args: argparse.Namespace) -> int:
    resolved = resolve(args)
    if not args.dry_run:
        check_cluster(args.cluster, num_nodes=resolved.plan.num_nodes, platform=resolved.platform)
        from megatron_hpc.data.preflight import check_data  # numpy, no torch

        check_data(resolved.cfg.data)
    run_dir = prepare_run_dir(args.out or default_run_dir(Path("runs"), resolved.cfg.name))
    req = SubmitRequest(
        cfg=resolved.cfg, plan=resolved.plan, platform=resolved.platform, cluster=args.cluster,
        run_dir=run_dir,
        options=SlurmOptions(partition=args.partition, account=args.account, qos=args.qos,
                             exclude=args.exclude, time_limit_min=args.time),
        recompile=args.recompile,
    )
    if args.dry_run:
        files = write_run_files(req)
        skipped = files.compile_skipped_by is not None
        if args.json:
            print(json.dumps({"run_dir": str(run_dir), "dry_run": True, "plan": resolved.plan.to_json(),
                              "compile_skipped": skipped, "fingerprint": files.fingerprint}, indent=2))
        else:
            print(format_plan(resolved.plan, vocab_size=resolved.cfg.model.vocab_size))
            if skipped:
                print(files.skip_message(req.cache_root))
            written = ", ".join(f"{p.phase}.sbatch" for p in files.phases)
            print(f"\nwrote {run_dir}: node.sh, {written}, submit.sh (nothing submitted)")
            print(f"submit by hand with: bash {run_dir}/submit.sh")
        return 0
    if not args.json:
        print(format_plan(resolved.plan, vocab_size=resolved.cfg.model.vocab_size))
        print(f"run folder: {run_dir}", flush=True)
    echo = None if args.json else (lambda line: print(line, flush=True))
    result = submit(req, wait=args.wait, echo=echo)
    _report(result, as_json=args.json)
    return 0 if result.ok else 1


def _report(result: SubmitResult, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps({
            "run_dir": str(result.run_dir), "ok": result.ok, "reason": result.reason,
            "compile_skipped": bool(result.files and result.files.compile_skipped_by is not None),
            "fingerprint": result.files.fingerprint if result.files else None,
            "jobs": [{"phase": j.phase, "job_id": j.job_id, "state": j.state, "depends_on": j.depends_on}
                     for j in result.jobs],
        }, indent=2))
        return
    for job in result.jobs:
        dep = f" (afterok:{job.depends_on})" if job.depends_on else ""
        print(f"{job.phase:<8} job {job.job_id}{dep}: {job.state}")
    if not result.ok:
        print(f"megatron-hpc: {result.reason}", file=sys.stderr)
