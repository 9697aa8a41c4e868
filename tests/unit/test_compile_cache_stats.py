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
