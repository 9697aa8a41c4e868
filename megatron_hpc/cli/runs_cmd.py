"""`megatron-hpc runs`: a table of recent runs under ./runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_hpc.launch.run_status import read_status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", type=Path, default=Path("runs"), help="folder holding the runs (default runs/)")
    parser.add_argument("--limit", type=int, default=20, help="how many of the newest runs to show")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


def run(args: argparse.Namespace) -> int:
    root = args.root.resolve()
    folders = sorted((p.parent for p in root.glob("*/*/plan.json")), key=lambda p: p.stat().st_mtime,
                     reverse=True)[: args.limit]
    statuses = [read_status(f) for f in folders]
    if args.json:
        print(json.dumps([s.to_json() for s in statuses], indent=2))
        return 0
    if not statuses:
        print(f"no runs under {root}")
        return 0
    print(f"{'run':<40} {'nodes':>5} {'state':<24} {'iteration':>12} {'lm loss':>9}")
    for s in statuses:
        state = " ".join(f"{j.phase[0]}:{j.state}" for j in s.jobs) or "written (dry run)"
        p = s.progress
        it = f"{p.iteration}/{p.train_iters or '?'}" if p else "-"
        loss = f"{p.lm_loss:.4f}" if p else "-"
        name = str(Path(s.run_dir).relative_to(root))
        print(f"{name:<40} {s.plan.get('num_nodes', '?'):>5} {state:<24} {it:>12} {loss:>9}")
    return 0
