"""An asynchronous save that fails on a disk that fills up, with two real ranks: every rank stops with the cause, the
tracker keeps naming the previous checkpoint, which still loads, and no half-written folder is left."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import mp_workers
import pytest

from megatron_hpc.checkpoint.store import paths, read_manifest
from megatron_hpc.config.schema import CheckpointConfig

pytestmark = pytest.mark.multiprocess


def _config(save: Path, num_steps: int):
    cfg = mp_workers.tiny_config(tp=2, num_steps=num_steps)
    return dataclasses.replace(cfg, checkpoint=CheckpointConfig(save=str(save), save_interval=2, keep_last=1,
                                                                async_save=True))


@pytest.fixture
def small_disk(tmp_path: Path):
    """A tmpfs sized from a real checkpoint of the same run: room for one and a half, so the second save, written
    while the first still exists (keep_last prunes only after a commit), runs out of space."""
    probe = tmp_path / "probe"
    mp_workers.spawn(mp_workers.sized_runs, world=2, out_dir=tmp_path / "probe-out",
                     args=([(2, _config(probe / "checkpoints", 2), "probe")], str(tmp_path / "probe-runs")))
    size = sum(f.stat().st_size for f in (probe / "checkpoints").rglob("*") if f.is_file())
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size * 3 // 2}", "tmpfs", str(mnt)], check=True,
                   capture_output=True)
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_disk_during_an_async_save_stops_every_rank_and_keeps_the_previous(tmp_path: Path,
                                                                                   small_disk: Path) -> None:
    errors = mp_workers.spawn(mp_workers.failing_run, world=2, out_dir=tmp_path / "out",
                              args=(_config(small_disk, 6), str(tmp_path / "run")))
    assert all("saving checkpoint 4" in e and "The previous checkpoint is unchanged" in e for e in errors), errors
    # The rank whose writer hit the full disk names it; a rank whose own files fitted says another rank failed.
    assert any("No space left on device" in e for e in errors), errors
    assert all("No space left on device" in e or "another rank failed" in e for e in errors), errors
    assert (small_disk / paths.TRACKER).read_text() == "2"
    assert sorted(p.name for p in small_disk.iterdir()) == ["iter_0000002", paths.TRACKER]
    assert read_manifest(small_disk / "iter_0000002").iteration == 2
    # Surfaced at the next save or the end: the steps after the failed save's start ran (4 -> 6 at most).
    iterations = [json.loads(line)["iteration"] for line in (tmp_path / "run" / "metrics.jsonl").read_text()
                  .splitlines()]
    assert iterations[:4] == [1, 2, 3, 4] and iterations[-1] <= 6
