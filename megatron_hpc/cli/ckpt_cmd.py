"""`megatron-hpc ckpt inspect PATH`: iteration, mesh and every tensor of a checkpoint (or one xser file)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="ckpt_command", metavar="SUBCOMMAND", required=True)
    p = sub.add_parser("inspect", help="iteration, mesh and tensors (name, shape, dtype) of a checkpoint")
    p.add_argument("path", type=Path, help="checkpoint folder (with the tracker), iter_XXXXXXX folder, "
                                           "or a model_optim_rng.pt file (ours or torch_xla's)")
    p.add_argument("--verify", action="store_true", help="check every file's size and sha256 (reads all data)")
    p.add_argument("--json", action="store_true", help="print JSON")


def format_summary(s: dict[str, Any]) -> str:
    def show(value: Any) -> str:
        return "?" if value is None else str(value)

    lines = [f"checkpoint  {s['path']}",
             f"iteration   {show(s['iteration'])} ({s['format']})",
             f"mesh        tp {show(s['tensor_parallel'])} dp {show(s['data_parallel'])} "
             f"world {show(s['world_size'])}"]
    if s.get("files") is not None:
        verified = ", verified" if s.get("verified") else ""
        lines.append(f"files       {s['files']} ({s['bytes']:,} bytes{verified})")
    rows = s["tensors"]
    width = max((len(r["name"]) for r in rows), default=4)
    lines.append(f"tensors     {len(rows)}")
    for r in rows:
        rank = f"[tp {r['tp_rank']}] " if "tp_rank" in r else ""
        lines.append(f"  {rank}{r['name']:<{width}}  {r['dtype']:<9} {tuple(r['shape'])}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from megatron_hpc.checkpoint.summary import summarize

    summary = summarize(args.path, verify=args.verify)
    print(json.dumps(summary, indent=1) if args.json else format_summary(summary))
    return 0
