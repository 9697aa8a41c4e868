"""`megatron-hpc logs RUN [--node K] [--phase P] [--follow]`: a node's log of a phase."""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
import time
from pathlib import Path

from megatron_hpc.errors import LaunchError
from megatron_hpc.launch.run_status import ENDED_STATES, RunAccessError, find_run_dir, read_status
from megatron_hpc.run_folder import CONFIG_FILE, LOG_DIR, node_log, read_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", nargs="?", help="run folder or job id (default: the most recent run)")
    parser.add_argument("--node", type=int, help="node index (default: the last node, which logs the iterations)")
    parser.add_argument("--phase", choices=("compile", "run"), help="default: the latest phase with logs")
    parser.add_argument("--follow", "-f", action="store_true", help="keep printing until the phase's job ends")


def pick_log(run_dir: Path, *, phase: str | None, node: int | None) -> Path:
    phases = [phase] if phase else ["run", "compile"]
    try:
        names = os.listdir(run_dir / LOG_DIR)  # a glob would take an unreadable folder for an empty one
    except (FileNotFoundError, NotADirectoryError):
        names = []
    except OSError as exc:
        raise RunAccessError(run_dir / LOG_DIR, exc) from None
    for name in phases:
        logs = sorted((run_dir / LOG_DIR / n for n in names if fnmatch.fnmatchcase(n, f"{name}-node*.log")),
                      key=lambda p: int(p.stem.rsplit("node", 1)[1]))
        if not logs:
            continue
        if node is None:
            return logs[-1]
        wanted = node_log(run_dir, name, int(node))
        if wanted.exists():
            return wanted
        raise LaunchError(f"no log for node {node} of the {name} phase; nodes with logs: "
                          + ", ".join(p.stem.rsplit("node", 1)[1] for p in logs))
    raise LaunchError(f"no {phase or 'compile or run'} phase logs in {run_dir / 'logs'} yet; "
                      "the job may still be queued (see `megatron-hpc status`)")


def run(args: argparse.Namespace) -> int:
    run_dir = find_run_dir(args.run)
    status = read_status(run_dir)
    if status.cluster == "k8s":  # node.sh logs to the run folder on the claim; the pods' logs hold the same lines
        from megatron_hpc.launch import k8s_api

        jobs = [j for j in status.jobs if args.phase in (None, j.phase)]
        if not jobs:
            raise LaunchError(f"no {args.phase or ''} job in {run_dir}; see `megatron-hpc status {run_dir}`")
        namespace = (read_json(run_dir / CONFIG_FILE).get("k8s") or {}).get("namespace") or "default"
        for chunk in k8s_api.pod_log(jobs[-1].job_id, namespace=namespace, node=args.node, follow=args.follow):
            sys.stdout.write(chunk)
        return 0
    log = pick_log(run_dir, phase=args.phase, node=args.node)
    phase = log.stem.split("-node")[0]
    offset = 0
    while True:
        try:
            with log.open(errors="replace") as fh:
                fh.seek(offset)
                sys.stdout.write(fh.read())
                offset = fh.tell()
        except PermissionError as exc:
            raise RunAccessError(log, exc) from None
        sys.stdout.flush()
        if not args.follow:
            return 0
        jobs = [j for j in read_status(run_dir).jobs if j.phase == phase]
        if not jobs or jobs[0].state in ENDED_STATES:
            return 0
        time.sleep(1.0)
