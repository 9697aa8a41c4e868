"""`cache stats` on a generated 100,000-entry stand-in tree prints the right counts. Its speed is measured by
benchmarks/cache_stats.py, not here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from megatron_hpc.cli.main import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import fake_neuron_cache as fake

NUM_ENTRIES = 100_000


@pytest.fixture
def big_root(tmp_path):
    # tmpfs when there is one: building and deleting 100k directories on a disk takes far longer
    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() else tmp_path / "big"
    try:
        yield root
    finally:
        # one `rm -rf` per version directory, side by side: a single rmtree of 100k dirs takes ~6 s
        rms = [subprocess.Popen(["rm", "-rf", "--", str(d)]) for d in root.iterdir()]
        for rm in rms:
            rm.wait()
        shutil.rmtree(root, ignore_errors=True)


def test_stats_counts_a_100k_entry_tree(big_root, capsys):
    expected = fake.build_large_tree(big_root, num_entries=NUM_ENTRIES)
    assert main(["cache", "stats", "--root", str(big_root), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["entries"] == NUM_ENTRIES
    assert {v: d["counts"] for v, d in out["versions"].items()} == expected
    assert out["counts"] == {s: NUM_ENTRIES // 4 for s in fake.STATES}
    assert out["bytes"] == 4 * NUM_ENTRIES // 4  # only the complete entries' 4-byte neffs hold data


@pytest.mark.parametrize("action", ["ls", "stats", "verify", "clear-locks", "clear-failed"])
def test_a_root_that_does_not_exist_is_refused_not_listed_empty(action, tmp_path, capsys):
    """`cache ls --root /typo` said "no entries" (rc 0), as if the cache were empty; every action reads an existing
    cache, so a --root that is not there is one line with the fix, and nothing is made there."""
    assert main(["cache", action, "--root", str(tmp_path / "typo")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"megatron-hpc: error: --root {tmp_path / 'typo'} does not exist; pass the cache's folder, or "
                   "leave --root out for the shared compile cache of submit"]
    assert not (tmp_path / "typo").exists()
