"""Worker processes for test_compile_tree_publish.py (run as a script, not imported by pytest).

    python tree_publish_workers.py reader SHARED EXPECTED.json STOP_FILE REPORT.json
    python tree_publish_workers.py sync-loop SHARED LOCAL STOP_FILE
    python tree_publish_workers.py compile-probe OUT.json

The reader checks, over and over until STOP_FILE exists, that every file visible under its final name in SHARED
is one of the expected files with the expected sha256 (hashed on first sight of each inode: a published file is
never written again), that no lock or temp folder of a source travelled, and that each visible Triton-style
`__grp__*.json` group names only files that are visible too. Dot-names are publishers' temp files in transit.
The expected table is written by the test from the trees it built, not by the code under test.

compile-probe compiles a small forward and backward with torch.compile (including a custom autograd.Function,
as our tensor-parallel mappings are) and writes the gradients and Inductor's cache counters to OUT.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path


def _visible_files(shared: Path) -> tuple[list[str], list[str]]:
    """(files under their final names, names that must never be there), relative to SHARED."""
    files, forbidden = [], []
    for dirpath, dirnames, filenames in os.walk(shared):
        rel_dir = os.path.relpath(dirpath, shared)
        forbidden += [os.path.join(rel_dir, d) for d in dirnames if d.startswith("tmp.")]
        for name in filenames:
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if name.endswith(".lock"):
                forbidden.append(rel)
            elif not name.startswith("."):
                files.append(rel)
    return files, forbidden


def reader(shared: Path, expected_file: Path, stop: Path, report_file: Path) -> int:
    expected = json.loads(expected_file.read_text())
    polls, checks, violations, hashed = 0, 0, [], set()
    while not stop.exists() or polls == 0:
        polls += 1
        files, forbidden = _visible_files(shared)
        violations += [f"{rel}: a lock or temp folder of a source travelled" for rel in forbidden]
        visible = set(files)
        for rel in files:
            if rel not in expected:
                violations.append(f"{rel}: not a shareable file of any node")
                continue
            path = shared / rel
            try:
                ino = os.lstat(path).st_ino
                if (rel, ino) in hashed:
                    continue
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
            except FileNotFoundError:
                violations.append(f"{rel}: vanished")
                continue
            hashed.add((rel, ino))
            checks += 1
            if digest != expected[rel]:
                violations.append(f"{rel}: sha256 {digest[:12]}, expected {expected[rel][:12]} (partial?)")
            if os.path.basename(rel).startswith("__grp__"):
                children = json.loads(path.read_text())["child_paths"]
                missing = [c for c in children if os.path.join(os.path.dirname(rel), c) not in visible]
                if missing:
                    violations.append(f"{rel}: group visible before its files {missing}")
        time.sleep(0.005)
    report_file.write_text(json.dumps({"polls": polls, "checks": checks, "violations": violations[:50]}))
    return 0


def sync_loop(shared: Path, local: Path, stop: Path) -> int:
    from megatron_hpc.cli.main import main

    while not stop.exists():
        if shared.is_dir() and main(["cache", "sync", "--layout", "tree", "--from", str(shared), "--to", str(local),
                                     "--json"]) != 0:
            return 1
        time.sleep(0.05)
    return 0


def compile_probe(out: Path) -> int:
    import torch
    from torch._dynamo.utils import counters

    class ScaleGrad(torch.autograd.Function):
        """fwd: identity | bwd: times 2 (a stand-in for a tensor-parallel mapping)."""

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    torch.manual_seed(0)
    weight = torch.randn(64)

    def step(x):
        return (ScaleGrad.apply(x).sin() * weight).sum()

    x = torch.randn(8, 64, requires_grad=True)
    torch.compile(step)(x).backward()
    out.write_text(json.dumps({
        "grad": x.grad.flatten().tolist(),
        "inductor": dict(counters["inductor"]),
        "aot_autograd": dict(counters["aot_autograd"]),
    }))
    return 0


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "reader":
        sys.exit(reader(*map(Path, rest)))
    if cmd == "sync-loop":
        sys.exit(sync_loop(*map(Path, rest)))
    sys.exit(compile_probe(Path(rest[0])))
