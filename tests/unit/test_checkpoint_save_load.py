"""save_checkpoint / find_checkpoint / load_checkpoint in one process (a world of one)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_hpc.checkpoint.store import (
    RankInfo,
    find_checkpoint,
    load_checkpoint,
    paths,
    read_manifest,
    save_checkpoint,
    saver,
)
from megatron_hpc.errors import CheckpointError

ONE = RankInfo()


def _state(iteration: int, *, n: int = 4, size: int = 64) -> dict:
    return {"iteration": iteration, "model": {f"w{i}": torch.full((size,), float(iteration + i)) for i in range(n)}}


def _save(root: Path, iteration: int, **kw) -> Path:
    return save_checkpoint(root, iteration, _state(iteration), ranks=ONE, **kw)


def test_layout_manifest_and_tracker(tmp_path: Path) -> None:
    folder = _save(tmp_path, 3)
    assert folder == tmp_path / "iter_0000003"
    assert (tmp_path / paths.TRACKER).read_text() == "3"  # no newline, as Megatron writes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", paths.TRACKER]
    manifest = read_manifest(folder)
    assert (manifest.iteration, manifest.tensor_parallel, manifest.data_parallel) == (3, 1, 1)
    on_disk = {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*")
               if p.is_file() and p.name != paths.MANIFEST}
    assert {k: r.size for k, r in manifest.files.items()} == on_disk
    assert "mp_rank_00/model_optim_rng.pt.tensors/tensor_3.pt" in on_disk
    found, state = load_checkpoint(tmp_path, ranks=ONE)
    assert found.iteration == 3 and torch.equal(state["model"]["w1"], torch.full((64,), 4.0))


def test_torch_format(tmp_path: Path) -> None:
    _save(tmp_path, 1, fmt="torch")
    assert sorted(read_manifest(tmp_path / "iter_0000001").files) == ["mp_rank_00/model_optim_rng.pt"]
    assert load_checkpoint(tmp_path, ranks=ONE)[1]["iteration"] == 1


def test_tracker_is_written_after_the_folder_is_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    real = saver.write_tracker

    def spy(root: Path, iteration: int) -> None:
        folder = paths.iteration_dir(root, iteration)
        seen.append((folder.is_dir(), (folder / paths.MANIFEST).is_file(),
                     any(paths.is_temp_dirname(p.name) for p in root.iterdir())))
        real(root, iteration)

    monkeypatch.setattr(saver, "write_tracker", spy)
    _save(tmp_path, 1)
    assert seen == [(True, True, False)]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_tensor_file_is_named(tmp_path: Path, damage: str) -> None:
    _save(tmp_path, 1)
    victim = tmp_path / "iter_0000001/mp_rank_00/model_optim_rng.pt.tensors/tensor_2.pt"
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        pos = len(data) - 100  # inside the tensor's bytes: still a valid zip, different values
        victim.write_bytes(data[:pos] + bytes([data[pos] ^ 0xFF]) + data[pos + 1:])
    else:
        victim.unlink()
    with pytest.raises(CheckpointError, match=r"tensor_2\.pt"):
        load_checkpoint(tmp_path, ranks=ONE)


def test_tracker_naming_missing_folder_falls_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for it in (1, 2):
        _save(tmp_path, it)
    (tmp_path / paths.TRACKER).write_text("7")
    found = find_checkpoint(tmp_path)
    assert found is not None and found.iteration == 2
    assert "iter_0000007, which is missing or incomplete; loading iter_0000002" in capsys.readouterr().err


def test_incomplete_and_temp_folders_are_never_chosen(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    (tmp_path / "iter_0000002" / paths.MANIFEST).unlink()  # as if the save died before the manifest
    (tmp_path / "iter_0000009.tmp-abc").mkdir()
    found = find_checkpoint(tmp_path)
    assert found is not None and found.iteration == 1
    (tmp_path / paths.TRACKER).unlink()
    assert find_checkpoint(tmp_path) is None  # no tracker: start from scratch, as Megatron
    _save(tmp_path, 3)
    assert not (tmp_path / "iter_0000009.tmp-abc").exists()  # the next save removes dead temp folders


def test_tracker_with_nothing_to_fall_back_on(tmp_path: Path) -> None:
    tmp_path.joinpath(paths.TRACKER).write_text("5")
    with pytest.raises(CheckpointError, match="no complete checkpoint before it; delete the tracker"):
        find_checkpoint(tmp_path)
    tmp_path.joinpath(paths.TRACKER).write_text("five")
    with pytest.raises(CheckpointError, match="not an iteration"):
        find_checkpoint(tmp_path)


def test_different_tensor_parallel_names_reshard(tmp_path: Path) -> None:
    _save(tmp_path, 4)
    with pytest.raises(CheckpointError, match=r"saved at tp 1 x pp 1 but this run has tp 2 x pp 1.*"
                                              r"`megatron-hpc ckpt reshard .*iter_0000004 --tp 2 --pp 1 --out "):
        load_checkpoint(tmp_path, ranks=RankInfo(tp_size=2))


def test_keep_last(tmp_path: Path) -> None:
    for it in range(1, 6):
        _save(tmp_path, it, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", "iter_0000005", paths.TRACKER]
    (tmp_path / "iter_0000009").mkdir()  # a newer folder of another run is not ours to delete
    (tmp_path / "iter_0000009" / paths.MANIFEST).write_text("{}")
    _save(tmp_path, 6, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000006", "iter_0000009", paths.TRACKER]


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 2 MiB tmpfs (we run as root in CI; a sandbox without mount rights fails here, not skips)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True, capture_output=True)
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_full_disk_keeps_previous_checkpoint(small_disk: Path) -> None:
    save_checkpoint(small_disk, 1, _state(1, n=8, size=4096), ranks=ONE)  # about 130 KiB
    big = _state(2, n=3, size=256 * 1024)  # 3 MiB: cannot fit
    with pytest.raises(CheckpointError, match=r"saving checkpoint 2 .* failed on rank 0: No space left on device"
                                              r".*previous checkpoint is unchanged"):
        save_checkpoint(small_disk, 2, big, ranks=ONE, keep_last=1)
    assert sorted(p.name for p in small_disk.iterdir()) == ["iter_0000001", paths.TRACKER]
    found, state = load_checkpoint(small_disk, ranks=ONE)
    assert found.iteration == 1 and torch.equal(state["model"]["w7"], torch.full((4096,), 8.0))
    assert json.loads((small_disk / "iter_0000001" / paths.MANIFEST).read_text())["iteration"] == 1
