"""`megatron-hpc runs`: a table of recent runs under ./runs.

A run this user may not read is listed and marked (`unreadable: Permission denied`, the file named on stderr),
never left out: the table says what is there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_hpc.launch.run_status import RunAccessError, read_status, scan_runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", type=Path, default=Path("runs"), help="folder holding the runs (default runs/)")
    parser.add_argument("--limit", type=int, default=20, help="how many of the newest runs to show")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


def run(args: argparse.Namespace) -> int:
    root = args.root.resolve()
    rows = []  # (folder, status or None, problem or None)
    for folder in scan_runs(root)[: args.limit]:
        if folder.problem:
            rows.append((folder.path, None, folder.problem))
            print(f"megatron-hpc: warning: {folder.message}", file=sys.stderr)
            continue
        try:
            rows.append((folder.path, read_status(folder.path), None))
        except RunAccessError as exc:
            rows.append((folder.path, None, exc.reason))
            print(f"megatron-hpc: warning: {exc}", file=sys.stderr)
    if args.json:
        print(json.dumps([s.to_json() if s else {"run_dir": str(path), "unreadable": problem}
                          for path, s, problem in rows], indent=2))
        return 0
    if not rows:
        print(f"no runs under {root}")
        return 0
    print(f"{'run':<40} {'nodes':>5} {'state':<24} {'iteration':>12} {'lm loss':>9}")
    for path, s, problem in rows:
        name = str(path.relative_to(root))
        if s is None:
            print(f"{name:<40} {'?':>5} {'unreadable: ' + str(problem):<24} {'-':>12} {'-':>9}")
            continue
        state = " ".join(f"{j.phase[0]}:{j.state}" for j in s.jobs) or "written (dry run)"
        p = s.progress
        it = f"{p.iteration}/{p.train_iters or '?'}" if p else "-"
        loss = f"{p.lm_loss:.4f}" if p else "-"
        print(f"{name:<40} {s.plan.get('num_nodes', '?'):>5} {state:<24} {it:>12} {loss:>9}")
    return 0
