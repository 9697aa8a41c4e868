"""file_io: torch files written from tensor memory and read into fresh memory, checksummed on the way."""

from __future__ import annotations

import hashlib
import json
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from megatron_hpc.checkpoint.store import RankInfo, load_checkpoint, paths, read_torch_file, save_checkpoint
from megatron_hpc.checkpoint.store.checksum import IMPLEMENTATION, crc32
from megatron_hpc.checkpoint.store.file_io import CHUNK, write_torch_file
from megatron_hpc.checkpoint.store.manifest import FileRecord
from megatron_hpc.errors import CheckpointError


def test_written_files_are_ordinary_torch_zips(tmp_path: Path) -> None:
    t = torch.randn(3 * CHUNK // 4 + 5)  # several chunks, and a ragged end
    path = tmp_path / "t.pt"
    written = write_torch_file(path, t)
    data = path.read_bytes()
    assert written.size == len(data) and written.crc32 == zlib.crc32(data)
    assert torch.equal(torch.load(path, weights_only=True), t)  # what torch_xla's xser.load calls
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None  # every record's CRC is right: unzip tools accept the file


def _records(path: Path) -> list[tuple[str, int, int, int, bytes]]:
    with zipfile.ZipFile(path) as zf:
        return [(i.filename, i.header_offset, i.file_size, i.CRC, zf.read(i)) for i in zf.infolist()]


@pytest.mark.parametrize("combine", [True, False], ids=["one-pass", "without-crc32_combine"])
def test_record_crcs_are_ours_and_the_zip_is_torchs_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         combine: bool) -> None:
    """torch.save inside write_torch_file computes no record crc32 (its code is 3-4x slower than the write); the
    sink puts ours where torch's go. The file is torch's own save of the object, record for record: the same names,
    offsets, sizes, bytes and crc32s, with every crc32 right (unzip -t and zipfile check them). Among the records:
    an empty one (torch writes it without a data descriptor), one whose 16 bytes look like a data descriptor with
    the sizes counted so far, one that looks like a local header, one over CHUNK, one whose last 16 bytes look like a
    descriptor after its first CHUNK, and a pickle over 64 KiB. With isal's crc32_combine each data piece is read
    once for the record's crc32 and the file's; without it (zlib's crc32 only) twice, to the same bytes."""
    from megatron_hpc.checkpoint.store import zip_crc

    monkeypatch.setattr(zip_crc, "CAN_COMBINE", combine and zip_crc.CAN_COMBINE)
    import subprocess
    from io import BytesIO

    obj = {"empty": torch.empty(0), "ones": torch.ones(3),
           "looks_like_descriptor": torch.tensor([0x08074B50, 7, 0, 0], dtype=torch.int32),
           "looks_like_header": torch.tensor([0x04034B50, 1, 2, 3], dtype=torch.int32),
           "big": torch.randn(CHUNK // 4 + 3), "names": [f"n{i}" for i in range(20000)],
           # over CHUNK, so the sink feeds it a CHUNK at a time: its last 16 bytes, fed alone, look like a descriptor
           "tail_looks_like_descriptor": torch.cat([torch.zeros(CHUNK // 4, dtype=torch.int32),
                                                    torch.tensor([0x08074B50, 9, CHUNK, CHUNK], dtype=torch.int32)])}
    path = tmp_path / "t.pt"
    written = write_torch_file(path, obj)
    data = path.read_bytes()
    assert written.size == len(data) and written.crc32 == zlib.crc32(data)
    assert torch.serialization.get_crc32_options()  # the process-wide option is back as it was

    seen = []

    class Probe:  # pickled inside the save: what torch's crc32 option is while torch.save runs
        def __reduce__(self) -> tuple:
            seen.append(torch.serialization.get_crc32_options())
            return (int, (0,))

    write_torch_file(tmp_path / "probe.pt", {"probe": Probe()})
    assert seen == [False]
    theirs = tmp_path / "theirs.pt"
    buffer = BytesIO()
    torch.save(obj, buffer, pickle_protocol=2)  # torch computing its own crc32s
    theirs.write_bytes(buffer.getvalue())
    ours_records, their_records = _records(path), _records(theirs)
    assert len(ours_records) == len(their_records) == 12
    for ours, their in zip(ours_records, their_records):
        assert ours[3] == zlib.crc32(ours[4])
        if not ours[0].endswith("serialization_id"):  # a random id per save
            assert ours == their
    assert subprocess.run(["unzip", "-tq", str(path)], capture_output=True).returncode == 0
    loaded = torch.load(path, weights_only=True)
    assert all(torch.equal(loaded[k], obj[k]) for k in obj if k != "names") and loaded["names"] == obj["names"]


def test_saves_on_several_threads_write_the_same_bytes(tmp_path: Path) -> None:
    """The saver writes files on a thread pool. torch keeps its crc32 option per thread (2.13) or one for the process
    (2.9, the XLA tier's); either way every save runs with torch's crc32 off, so the same object gives the same
    bytes whatever the timing (torch derives its serialization_id record from the crc32s it computed), and the
    option is as it was once the saves are done."""
    from concurrent.futures import ThreadPoolExecutor

    obj = {"x": torch.arange(300000.0)}
    with ThreadPoolExecutor(4) as pool:
        crcs = set(pool.map(lambda i: write_torch_file(tmp_path / f"{i}.pt", obj).crc32, range(32)))
    assert len(crcs) == 1 and torch.serialization.get_crc32_options()
    with zipfile.ZipFile(tmp_path / "7.pt") as zf:
        assert zf.testzip() is None


def test_a_record_torch_did_not_write_as_known_is_refused_not_written_wrong() -> None:
    """The filler counts each record from torch's writes; a central directory that disagrees with what it counted
    (a torch that writes its zips another way) is refused rather than given crc32s of the wrong bytes."""
    from megatron_hpc.checkpoint.store.zip_crc import Filler

    class Recorder:  # torch.save's writes, one by one, as the sink receives them
        def __init__(self) -> None:
            self.writes: list[bytearray] = []

        def write(self, data: bytes) -> int:
            self.writes.append(bytearray(memoryview(data).cast("B")))
            return len(self.writes[-1])

        def flush(self) -> None:
            pass

    recorder = Recorder()
    torch.save({"x": torch.ones(4)}, recorder, pickle_protocol=2)
    filler = Filler()
    for write in recorder.writes:
        if write[:4] == b"PK\x01\x02":
            struct.pack_into("<I", write, 20, 999)  # the first entry's compressed size: not the size counted
        filler.feed(memoryview(write))
    with pytest.raises(CheckpointError, match=r"entry 0 \(record at byte 0, 999 bytes\) is not the record counted"):
        filler.finish()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_tensor_read_into_fresh_memory(tmp_path: Path, dtype: torch.dtype) -> None:
    t = (torch.randn(37, 11) * 10).to(dtype)
    path = tmp_path / "t.pt"
    rec = write_torch_file(path, t)
    back = read_torch_file(path, expected=FileRecord(size=rec.size, crc32=rec.crc32))
    assert back.dtype == dtype and torch.equal(back, t)
    back.add_(1) if dtype != torch.bool else back.logical_not_()  # its own memory: writable, file untouched
    assert torch.equal(torch.load(path, weights_only=True), t)


def test_view_of_a_larger_storage_keeps_offset_and_strides(tmp_path: Path) -> None:
    # torch.save of a view writes the whole storage; torch_xla's saver can leave such files.
    base = torch.arange(200.0)
    view = base[10:90].view(8, 10)[:, ::3]
    torch.save(view, tmp_path / "v.pt")
    back = read_torch_file(tmp_path / "v.pt")
    assert back.shape == view.shape and back.stride() == view.stride() and torch.equal(back, view)


def test_objects_that_are_not_one_tensor_take_the_whole_file_path(tmp_path: Path) -> None:
    obj = {"a": torch.ones(3), "b": [torch.zeros(2), 7]}
    rec = write_torch_file(tmp_path / "o.pt", obj)
    back = read_torch_file(tmp_path / "o.pt", expected=FileRecord(size=rec.size, crc32=rec.crc32))
    assert torch.equal(back["a"], obj["a"]) and back["b"][1] == 7


def test_altered_data_byte_fails_the_crc(tmp_path: Path) -> None:
    t = torch.randn(4096)
    path = tmp_path / "t.pt"
    rec = write_torch_file(path, t)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the data record: the zip still parses
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"t\.pt has crc32 .* but the manifest says"):
        read_torch_file(path, expected=FileRecord(size=rec.size, crc32=rec.crc32))


def test_version_1_manifests_with_sha256_still_load(tmp_path: Path) -> None:
    """Checkpoints written before crc32 (manifest_version 1, sha256 per file) load, and damage is still found."""
    ranks = RankInfo()
    folder = save_checkpoint(tmp_path, 5, {"iteration": 5, "model": {"w": torch.arange(6.0)}}, ranks=ranks)
    manifest = json.loads((folder / paths.MANIFEST).read_text())
    manifest["manifest_version"] = 1
    manifest["files"] = {rel: {"size": rec["size"], "sha256": hashlib.sha256((folder / rel).read_bytes()).hexdigest()}
                         for rel, rec in manifest["files"].items()}
    (folder / paths.MANIFEST).write_text(json.dumps(manifest))
    _found, state = load_checkpoint(tmp_path, ranks=ranks)
    assert torch.equal(state["model"]["w"], torch.arange(6.0))
    victim = folder / "mp_rank_00/model_optim_rng.pt.tensors/tensor_0.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensor_0\.pt has sha256"):
        load_checkpoint(tmp_path, ranks=ranks)


def test_filesystem_without_mmap_still_loads_the_checked_bytes(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_hpc.checkpoint.store import file_io

    real = file_io.safe_load

    def no_mmap(source, *, what, mmap=False, allowed=()):
        if mmap:
            raise CheckpointError(f"{what} cannot be mapped (test)")
        return real(source, what=what, allowed=allowed)

    monkeypatch.setattr(file_io, "safe_load", no_mmap)
    t = torch.randn(5, 7)
    rec = write_torch_file(tmp_path / "t.pt", t)
    back = read_torch_file(tmp_path / "t.pt", expected=FileRecord(size=rec.size, crc32=rec.crc32))
    assert torch.equal(back, t)


@pytest.mark.parametrize("nbytes", [0, 1, 5 * 1024 + 3, CHUNK + 17])
def test_checksum_is_zlibs_crc32(nbytes: int) -> None:
    """The manifest's checksum (isal's when installed) gives zlib's values, whole and as a running value."""
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy().tobytes()
    assert crc32(data) == zlib.crc32(data)
    cut = nbytes // 3
    assert crc32(data[cut:], crc32(data[:cut])) == zlib.crc32(data)
    assert crc32(memoryview(data)[cut:], 0x1234abcd) == zlib.crc32(data[cut:], 0x1234abcd)


def test_crc32_combine_is_zlibs() -> None:
    """The file's crc32 is put together from each data piece's own (file_io, zip_crc): the same as over the bytes."""
    import os

    from megatron_hpc.checkpoint.store.checksum import crc32_combine

    a, b = os.urandom(1001), os.urandom(CHUNK + 7)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert crc32_combine(0, zlib.crc32(b), len(b)) == zlib.crc32(b)


def test_checksum_comes_from_isal() -> None:
    assert IMPLEMENTATION == "isal", "isal is not installed (setup.cfg needs it): pip install -e . again"


@pytest.mark.parametrize("where", ["first", "chunk edge", "middle", "last"])
def test_altered_byte_of_a_multi_chunk_tensor_fails_the_crc_and_names_the_file(tmp_path: Path, where: str) -> None:
    """The running checksum over the pieces a large tensor is read in catches a flip in any of them."""
    ranks = RankInfo()
    big = torch.randn(2 * CHUNK // 4 + 1001)  # three pieces, the last one ragged
    folder = save_checkpoint(tmp_path, 3, {"iteration": 3, "model": {"w": big, "b": torch.ones(3)}}, ranks=ranks)
    victim = folder / "mp_rank_00/model_optim_rng.pt.tensors/tensor_0.pt"
    data = bytearray(victim.read_bytes())
    with zipfile.ZipFile(victim) as zf:
        info = next(i for i in zf.infolist() if "/data/" in i.filename)
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)  # zip local header (APPNOTE 4.3.7)
    start = info.header_offset + 30 + name_len + extra_len
    assert data[start:start + info.file_size] == big.numpy().tobytes()  # the data record lies where we flip
    at = {"first": start, "chunk edge": start + CHUNK, "middle": start + info.file_size // 2,
          "last": start + info.file_size - 1}[where]
    data[at] ^= 0x40
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensor_0\.pt has crc32 .* but the manifest says"):
        load_checkpoint(tmp_path, ranks=ranks)


def test_writeback_starts_step_by_step_and_the_file_is_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """Every WRITEBACK_STEP bytes the kernel is asked to start writing the next range (sync_file_range on Linux);
    the ranges follow each other from 0, and the file is the same torch zip with the same checksum."""
    from megatron_hpc.checkpoint.store import file_io, writeback

    calls: list[tuple[int, int, bool]] = []

    def spy(fd: int, offset: int, nbytes: int) -> bool:
        done = writeback.start_writeback(fd, offset, nbytes)
        calls.append((offset, nbytes, done))
        return done

    step = 1 << 20
    monkeypatch.setattr(file_io, "WRITEBACK_STEP", step)
    monkeypatch.setattr(file_io, "start_writeback", spy)
    t = torch.randn(5 * step // 4 + 3)  # 5 MiB and a ragged end
    path = tmp_path / "t.pt"
    written = write_torch_file(path, t)
    data = path.read_bytes()
    assert written.crc32 == zlib.crc32(data) and torch.equal(torch.load(path, weights_only=True), t)
    assert len(calls) >= 2 and all(done for _, _, done in calls)  # Linux: each request taken
    assert [c[0] for c in calls] == [sum(c[1] for c in calls[:i]) for i in range(len(calls))]  # back to back
    assert all(n >= step for _, n, _ in calls) and sum(n for _, n, _ in calls) > len(data) - step
