"""The multiprocess and slurm markers stay in their folders: tests/run.sh's multiprocess and slurm sessions do not
collect the other folders, and the unit session deselects both markers, so such a test anywhere else would run in
no session at all."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
HOME = {"multiprocess": "multiprocess", "slurm": "slurm"}


def test_tier_markers_are_used_only_in_their_folders() -> None:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for marker in re.findall(r"pytest\.mark\.(multiprocess|slurm)\b", path.read_text()):
            found.append((marker, path.relative_to(TESTS).parts[0]))
    assert {marker for marker, _ in found} == set(HOME)  # the scan sees both markers in use
    assert [(marker, folder) for marker, folder in found if folder != HOME[marker]] == []
