"""Worker processes for test_compile_cache_concurrency.py (run as a script, not imported by pytest).

    python compile_cache_workers.py reader SHARED EXPECTED.json STOP_FILE REPORT.json
    python compile_cache_workers.py sync-loop SHARED LOCAL STOP_FILE

The reader checks, over and over until STOP_FILE exists, that every MODULE_* directory visible in SHARED holds
exactly the expected files with the expected sha256. Contents are hashed on first sight of each directory
inode (an entry renamed into place is never written again); file names are checked on every poll. The expected
table is written by the test from the stand-in tree it built, not by the code under test. Nothing removes
entries from SHARED during the run, so a missing file in a visible entry is a partial entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path


def _check_entry(entry: Path, expected: dict[str, str]) -> str | None:
    try:
        names = sorted(os.listdir(entry))
        if names != sorted(expected):
            return f"{entry}: files {names}, expected {sorted(expected)}"
        for name, digest in expected.items():
            got = hashlib.sha256((entry / name).read_bytes()).hexdigest()
            if got != digest:
                return f"{entry}/{name}: sha256 {got[:12]}, expected {digest[:12]}"
    except FileNotFoundError as exc:
        return f"{entry}: vanished while being read ({exc})"
    return None


def reader(shared: Path, expected_file: Path, stop: Path, report_file: Path) -> int:
    expected = json.loads(expected_file.read_text())
    polls, checks, seen, violations, hashed = 0, 0, set(), [], set()
    while not stop.exists() or polls == 0:
        polls += 1
        for version in shared.glob("neuronxcc-*"):
            for entry in version.glob("MODULE_*"):
                if entry.is_symlink():
                    continue
                key = f"{version.name}/{entry.name}"
                if key not in expected:
                    violations.append(f"{key}: not a complete entry of any node")
                    continue
                try:
                    ino = entry.stat(follow_symlinks=False).st_ino
                except FileNotFoundError:
                    violations.append(f"{key}: vanished")
                    continue
                names = sorted(os.listdir(entry))
                if (key, ino) in hashed and names == sorted(expected[key]):
                    continue
                problem = _check_entry(entry, expected[key])
                hashed.add((key, ino))
                checks += 1
                seen.add(key)
                if problem:
                    violations.append(problem)
        time.sleep(0.005)
    report_file.write_text(json.dumps({"polls": polls, "checks": checks, "seen": sorted(seen),
                                       "violations": violations[:50]}))
    return 0


def sync_loop(shared: Path, local: Path, stop: Path) -> int:
    from megatron_hpc.cli.main import main

    while not stop.exists():
        if main(["cache", "sync", "--from", str(shared), "--to", str(local), "--json"]) != 0:
            return 1
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "reader":
        sys.exit(reader(*map(Path, rest)))
    sys.exit(sync_loop(*map(Path, rest)))
