"""One torch file between tensor memory and disk, checksummed on the way (crc32), with as few copies as we can.

Why: a checkpoint's time is bytes moved. Serialising each tensor into a buffer, hashing the buffer and then writing it
costs two copies and a slow hash per byte (benchmarks/RESULTS.md, issue 5). Here:

- Writing: torch.save writes into `_WriteSink`, a file object. torch's zip writer hands it each record as one
  memoryview, the tensor's own memory for the data record, so the bytes go from the tensor to the page cache in one
  copy, checksummed piece by piece just before each piece is written (still in the CPU's cache). The files are the
  ordinary torch.save zip format, record CRCs included, so torch.load, torch_xla's xser loader and `unzip -t` read
  them; the record CRCs are computed here on the way (zip_crc.py), not by torch's much slower code.
- Reading a tensor file (one tensor in one storage: what xser writes per tensor): the zip directory says where the
  data record lies; the file is read in order into a small head, the memory of a fresh tensor, and a small tail,
  each piece checksummed right after it arrived. torch.load with mmap=True (weights only) gives the dtype, shape and
  strides without reading the data, and the result is a view of the fresh memory. Any other file (the main file, a
  file of several storages, a compressed or non-zip file) is read whole and loaded from memory, checksummed the same.
- Reading into a tensor that already exists (a CPU resume's model weights: tensor_layout, then read_tensor_into): the
  elements go from the page cache straight into it. Fresh memory costs a page fault per 4 KiB, 0.5 s/GiB on the CI
  VM, more than the read itself (benchmarks/RESULTS.md, issue 15), and the trainer would copy a fresh tensor into
  the model anyway.

The checksum is zlib's crc32, computed by ISA-L (checksum.py: 3x faster, the same values). It and the reads and writes
release the GIL, so the saver's and loader's threads overlap checksums with I/O.

Writeback starts while a file is still being written (writeback.py): every WRITEBACK_STEP bytes the kernel is asked to
start putting them on the disk, so the disk works while torch.save and the caller go on, and the fsync at the end
(kept: it is what makes the file durable) waits for the last step only, not the whole file.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_hpc.checkpoint.store import safe_pickle, zip_crc
from megatron_hpc.checkpoint.store.checksum import crc32, crc32_combine
from megatron_hpc.checkpoint.store.manifest import FileRecord
from megatron_hpc.checkpoint.store.writeback import WRITEBACK_STEP, start_writeback
from megatron_hpc.errors import CheckpointAccessError, CheckpointError

CHUNK = 4 << 20
"""Bytes checksummed and then written or read at a time: small enough to still be in cache for the second pass."""
_SMALL = 64 << 10
"""Records smaller than this (zip headers, the pickle) are gathered and written together."""
_MAX_FOREIGN = 64
"""Distinct Megatron classes answered by stand-ins in one file before it is refused."""
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header, 30 bytes (APPNOTE 4.3.7)


@dataclass(frozen=True, kw_only=True, slots=True)
class Written:
    size: int
    crc32: int


def _write_all(fd: int, view: memoryview) -> None:
    while view.nbytes:
        done = os.write(fd, view)
        view = view[done:]


class _WriteSink:
    """The file object torch.save writes into: small records are gathered, large ones leave from the caller's memory."""

    def __init__(self, fd: int):
        self._fd = fd
        self._zip = zip_crc.Filler()
        self._pending = bytearray()
        self._written = 0
        self._kicked = 0
        """Bytes handed to the kernel so far, and of those, bytes whose writeback was started."""
        self.size = 0
        self.crc = 0
        self.error: OSError | None = None
        """The first failed write (a full disk, say): torch's writer reports it as an unrelated RuntimeError."""

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        # A large record goes through the filler a CHUNK at a time, so its crc32 and the file's are both taken while
        # the chunk is in the CPU's cache, just before it is written. (A last chunk of 16 or 24 bytes that looks like
        # a data descriptor is held and found to be data by the filler, as any such write is.)
        chunks = [view[at:at + CHUNK] for at in range(0, view.nbytes, CHUNK)] if view.nbytes >= _SMALL else [view]
        for chunk in chunks:
            for piece, crc in self._zip.feed(chunk):
                self._put(memoryview(piece), crc)
        self.size += view.nbytes
        return view.nbytes

    def end_zip(self) -> None:
        """torch.save has returned: its central directory goes out, with the records' crc32 (zip_crc.py)."""
        self._put(memoryview(self._zip.finish()), None)
        self.drain()

    def _put(self, view: memoryview, crc: int | None) -> None:
        """Write `view` (crc: its crc32 when the filler took it; a view with one is at most a CHUNK)."""
        n = view.nbytes
        if n < _SMALL:
            self._pending += view
            if len(self._pending) >= CHUNK:
                self.drain()
        elif crc is not None:
            self.drain()
            self._out(view, crc)
        else:
            self.drain()
            for start in range(0, n, CHUNK):
                self._out(view[start:start + CHUNK])

    def _out(self, view: memoryview, crc: int | None = None) -> None:
        # The file's crc32 from the piece's own where the filler took it: the bytes are read once for both.
        self.crc = crc32(view, self.crc) if crc is None else crc32_combine(self.crc, crc, view.nbytes)
        try:
            _write_all(self._fd, view)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self._written += view.nbytes
        if self._written - self._kicked >= WRITEBACK_STEP:
            start_writeback(self._fd, self._kicked, self._written - self._kicked)
            self._kicked = self._written

    def drain(self) -> None:
        if self._pending:
            self._out(memoryview(self._pending))
            self._pending = bytearray()

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:  # torch.save calls it; bytes go out in drain()
        pass


def write_torch_file(path: Path, obj: Any, *, pickle_module: Any = pickle) -> Written:
    """torch.save(obj) into the new file `path` (it must not exist), fsynced; its size and crc32."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        sink = _WriteSink(fd)
        try:
            with zip_crc.torch_crc_off():
                torch.save(obj, sink, pickle_module=pickle_module, pickle_protocol=2)
            sink.end_zip()
            os.fsync(fd)
        except (RuntimeError, OSError) as exc:
            error = sink.error or exc
            if isinstance(error, OSError):  # os.write's error names no file; the user needs to know which
                raise OSError(error.errno, error.strerror, str(path)) from None
            raise
    finally:
        os.close(fd)
    return Written(size=sink.size, crc32=sink.crc)


def write_bytes_file(path: Path, data: bytes) -> Written:
    """`data` into the new file `path`, fsynced; its size and crc32."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        _write_all(fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)
    return Written(size=len(data), crc32=crc32(data))


def safe_load(source: io.BytesIO | Path, *, what: Path, mmap: bool = False,
              allowed: tuple[type, ...] = ()) -> Any:
    """torch.load that never runs code from the file: weights only, plus what Megatron-family checkpoints hold
    (safe_pickle.py) and the `allowed` classes. Megatron's own classes come back as inert ForeignObjects."""
    foreign: list[str] = []
    while True:
        try:
            if isinstance(source, io.BytesIO):
                source.seek(0)
            with torch.serialization.safe_globals(safe_pickle.allowed_globals(allowed, tuple(foreign))):
                return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
        except PermissionError as exc:  # an OSError too, but no sign of damage
            raise CheckpointAccessError(what, exc) from None
        except pickle.UnpicklingError as exc:
            # A class of Megatron's (an enum in `args`): answer it with a stand-in and read the file again. The
            # refusal comes when the global is named, before anything is called, and `args` comes first.
            name = safe_pickle.refused_global(str(exc))
            if name and safe_pickle.is_foreign(name) and name not in foreign and len(foreign) < _MAX_FOREIGN:
                foreign.append(name)
                continue
            raise CheckpointError(safe_pickle.refusal(what, str(exc))) from None
        except (RuntimeError, EOFError, ValueError, OSError) as exc:
            raise CheckpointError(f"{what} is not a readable torch file ({type(exc).__name__}: "
                                  f"{str(exc).strip()[:200]}); it is truncated or damaged") from None


def _read_into(fd: int, view: memoryview, offset: int, crc: int) -> int:
    """Fill `view` from the file at `offset`, chunk by chunk; the running crc32 over what was read."""
    done = 0
    while done < view.nbytes:
        piece = view[done:done + CHUNK]
        got = os.preadv(fd, [piece], offset + done)
        if got == 0:
            raise EOFError(f"the file ended {view.nbytes - done} bytes early")
        crc = crc32(piece[:got], crc)
        done += got
    return crc


def _data_record(fh: Any) -> tuple[int, int] | None:
    """(offset, size) of the only data record of a torch zip file, if it is stored uncompressed; else None."""
    records = _data_records(fh)
    return records[0] if records is not None and len(records) == 1 else None


def _data_records(fh: Any) -> list[tuple[int, int]] | None:
    """(offset, size) of every data record (a storage's elements) of a torch zip file, if all are stored uncompressed
    in little-endian order; else None."""
    try:
        with zipfile.ZipFile(fh) as zf:
            records = [i for i in zf.infolist() if "/data/" in i.filename and "/.data/" not in i.filename]
            if any(info.compress_type != zipfile.ZIP_STORED for info in records):
                return None
            order = [i for i in zf.infolist() if i.filename.endswith("/byteorder")]
            if order and zf.read(order[0]) != b"little":  # torch.load would swap the bytes; leave that to it
                return None
        out = []
        for info in records:
            fh.seek(info.header_offset)
            header = _LOCAL_HEADER.unpack(fh.read(_LOCAL_HEADER.size))
            if header[0] != b"PK\x03\x04":
                return None
            name_len, extra_len = header[9], header[10]
            out.append((info.header_offset + _LOCAL_HEADER.size + name_len + extra_len, info.file_size))
    except (zipfile.BadZipFile, OSError, ValueError, struct.error, EOFError, KeyError, NotImplementedError):
        return None  # damaged or unusual: the generic path reads, checks and reports it
    return out


def data_records(path: Path) -> dict[int, int] | None:
    """Offset -> size of every data record of the torch file `path` (see _data_records), None when unusual."""
    with open(path, "rb") as fh:
        return dict(_data_records(fh) or []) or None


def _check_size(path: Path, size: int, expected: FileRecord | None) -> None:
    if expected is not None and size != expected.size:
        raise CheckpointError(f"{path} has {size} bytes but the manifest says {expected.size} "
                              "(truncated or altered); load an earlier checkpoint")


def _check(path: Path, *, size: int, crc: int, data: bytes | None, expected: FileRecord | None) -> None:
    if expected is None:
        return
    _check_size(path, size, expected)
    if expected.crc32 is not None and crc != expected.crc32:
        raise CheckpointError(f"{path} has crc32 {crc:08x} but the manifest says {expected.crc32:08x} "
                              "(altered); load an earlier checkpoint")
    if expected.sha256 is not None:  # manifests of version 1
        assert data is not None, "version-1 records take the whole-file path, which passes the bytes"
        digest = hashlib.sha256(data).hexdigest()
        if digest != expected.sha256:
            raise CheckpointError(f"{path} has sha256 {digest[:16]}... but the manifest says "
                                  f"{expected.sha256[:16]}... (altered); load an earlier checkpoint")


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorLayout:
    """Where a one-tensor file keeps its elements: read from its zip directory and pickle, not yet checksummed."""

    dtype: torch.dtype
    shape: torch.Size
    size: int
    """The file's bytes."""
    data: tuple[int, int]
    """(offset, bytes) of the data record: the elements, contiguous, in native (little-endian) order."""


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete, load an earlier one") from None
    except OSError as exc:  # permission, or the disk: the file is there, so nothing says it is damaged
        raise CheckpointAccessError(path, exc) from None


def tensor_layout(path: Path, *, expected: FileRecord | None = None,
                  allowed: tuple[type, ...] = ()) -> TensorLayout | None:
    """The layout of a file holding one contiguous tensor that owns its whole storage (what xser writes per tensor),
    without reading the elements; None for any other file (read_torch_file reads, checks and reports it).

    A missing file, or one whose size is not the manifest's, raises here: before anything is read into memory that
    matters. The checksum can only be checked by read_tensor_into, once the bytes have passed.
    """
    fd = _open(path)
    try:
        size = os.fstat(fd).st_size
        _check_size(path, size, expected)
        if expected is not None and expected.sha256 is not None:  # version 1: sha256 needs the whole file at once
            return None
        with os.fdopen(os.dup(fd), "rb") as fh:
            record = _data_record(fh)
    finally:
        os.close(fd)
    if record is None or record[0] + record[1] > size:
        return None
    try:
        meta = safe_load(path, what=path, mmap=True, allowed=allowed)
    except CheckpointError:  # damaged, or no mmap here: the whole-file path reads and reports it
        return None
    if (type(meta) is not torch.Tensor or not meta.is_contiguous() or meta.storage_offset() != 0
            or meta.untyped_storage().nbytes() != record[1] or meta.numel() * meta.element_size() != record[1]):
        return None
    return TensorLayout(dtype=meta.dtype, shape=meta.shape, size=size, data=record)


def read_tensor_into(path: Path, target: torch.Tensor, layout: TensorLayout, *,
                     expected: FileRecord | None = None) -> None:
    """Read the file's elements straight into `target` (a contiguous CPU tensor of layout's dtype and shape), the
    crc32 computed on the same pass, then check the file against `expected`.

    No other memory is touched: the kernel copies from the page cache into `target`. When the checksum or size turns
    out wrong, CheckpointError names the file and `target` holds the damaged bytes: the caller must drop it (the
    trainer's restore aborts the run).
    """
    if (target.device.type != "cpu" or not target.is_contiguous() or target.dtype != layout.dtype
            or target.shape != layout.shape):
        raise ValueError(f"cannot read {path} ({layout.dtype}, {tuple(layout.shape)}) into a {target.dtype} "
                         f"{tuple(target.shape)} tensor on {target.device}")
    offset, nbytes = layout.data
    head, tail = bytearray(offset), bytearray(layout.size - offset - nbytes)
    elements = target.detach().reshape(-1).view(torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    fd = _open(path)
    try:
        size = os.fstat(fd).st_size
        if size != layout.size:
            raise CheckpointError(f"{path} changed while it was read ({size} bytes, {layout.size} before); "
                                  "load it again")
        crc = _read_into(fd, memoryview(head), 0, 0)
        crc = _read_into(fd, memoryview(elements.numpy()), offset, crc)
        crc = _read_into(fd, memoryview(tail), offset + nbytes, crc)
    except EOFError as exc:
        raise CheckpointError(f"{path} changed while it was read ({exc}); load it again") from None
    finally:
        os.close(fd)
    _check(path, size=size, crc=crc, data=None, expected=expected)


def verify_file(path: Path, expected: FileRecord) -> None:
    """Check the file against its manifest record (size, crc32 or sha256), reading it a chunk at a time: nothing of
    it stays in this process (a convert that maps a large file checks it first without holding it)."""
    fd = _open(path)
    crc, sha = 0, hashlib.sha256() if expected.sha256 is not None else None
    buffer = bytearray(CHUNK)
    done = 0
    try:
        size = os.fstat(fd).st_size
        _check_size(path, size, expected)
        while n := os.readv(fd, [buffer]):
            view = memoryview(buffer)[:n]
            crc = crc32(view, crc)
            if sha is not None:
                sha.update(view)
            done += n
    finally:
        os.close(fd)
    if done != size:
        raise CheckpointError(f"{path} changed while it was read ({done} of {size} bytes); load it again")
    _check(path, size=size, crc=crc, data=None, expected=FileRecord(size=expected.size, crc32=expected.crc32))
    if sha is not None and sha.hexdigest() != expected.sha256:
        raise CheckpointError(f"{path} has sha256 {sha.hexdigest()[:16]}... but the manifest says "
                              f"{str(expected.sha256)[:16]}... (altered); load an earlier checkpoint")


def read_torch_file(path: Path, *, expected: FileRecord | None = None, allowed: tuple[type, ...] = ()) -> Any:
    """Load one torch file (CPU), checked against `expected` when given; see the module docstring."""
    fd = _open(path)
    try:
        size = os.fstat(fd).st_size
        _check_size(path, size, expected)
        with os.fdopen(os.dup(fd), "rb") as fh:
            record = _data_record(fh) if expected is None or expected.sha256 is None else None
        if record is not None and record[0] + record[1] <= size:
            return _read_tensor_file(path, fd, size=size, record=record, expected=expected, allowed=allowed)
        # One bytes object: BytesIO shares it, so torch.load's copy of each storage is the only other one.
        with os.fdopen(os.dup(fd), "rb", buffering=0) as fh:
            fh.seek(0)  # the duplicate shares the offset the zip directory read moved
            data = fh.read()
    finally:
        os.close(fd)
    if len(data) != size:
        raise CheckpointError(f"{path} changed while it was read ({len(data)} of {size} bytes); load it again")
    _check(path, size=size, crc=crc32(data), data=data, expected=expected)
    return safe_load(io.BytesIO(data), what=path, allowed=allowed)


def _read_tensor_file(path: Path, fd: int, *, size: int, record: tuple[int, int], expected: FileRecord | None,
                      allowed: tuple[type, ...]) -> Any:
    """The file's object; a lone tensor is read into its own memory and returned as a view of it."""
    offset, nbytes = record
    head, tail = bytearray(offset), bytearray(size - offset - nbytes)
    data = torch.empty(nbytes, dtype=torch.uint8)
    try:
        crc = _read_into(fd, memoryview(head), 0, 0)
        crc = _read_into(fd, memoryview(data.numpy()), offset, crc)
        crc = _read_into(fd, memoryview(tail), offset + nbytes, crc)
    except EOFError as exc:
        raise CheckpointError(f"{path} changed while it was read ({exc}); load it again") from None
    _check(path, size=size, crc=crc, data=None, expected=expected)
    # The bytes are good; the pickle gives dtype, shape and strides (mapped again from the page cache, not copied).
    # Checkpoints are never rewritten in place, so the mapped pickle is the one just checked. Where mapping fails
    # (a filesystem without mmap), or the file is not one tensor after all, the checked bytes are loaded instead.
    try:
        meta = safe_load(path, what=path, mmap=True, allowed=allowed)
    except CheckpointError:
        meta = None
    if type(meta) is not torch.Tensor or meta.untyped_storage().nbytes() != nbytes:
        whole = bytes(head) + data.numpy().tobytes() + bytes(tail)
        return safe_load(io.BytesIO(whole), what=path, allowed=allowed)
    out = torch.empty(0, dtype=meta.dtype)
    out.set_(data.untyped_storage(), meta.storage_offset(), meta.shape, meta.stride())
    return out
