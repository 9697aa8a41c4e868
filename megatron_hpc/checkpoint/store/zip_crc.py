"""The zip records' crc32 of a torch.save, filled in as its bytes pass, so torch itself need not compute them.

Why: torch.save's zip writer computes each record's crc32 with miniz's compact table code, which on the CI VM took
3-4x as long as writing the record (a 1.25 GiB save: 3.8 s with torch's crc, 0.9 s without, benchmarks/RESULTS.md,
issue 27). torch lets a save skip it (torch.serialization.set_crc32_options(False)) and writes 0 instead; torch.load
never checks it, but `unzip -t`, Python's zipfile and every other zip reader do, and our files promise to be
ordinary zips. So the sink torch.save writes into (file_io._WriteSink) passes each write through a `Filler`, which
computes each record's crc32 with ISA-L (checksum.py) while the bytes pass and puts it where torch would have:

- torch writes every record as a local header (bit 3 set: crc and sizes follow the data), its name, an extra field
  (the alignment padding), the data, and a data descriptor (`PK\\7\\8`, crc32, both sizes: 16 bytes, or 24 with
  zip64 sizes), each one write call; an empty record is its header (bit 3 clear, crc 0), name and extra field alone;
  then the central directory, zip64 end records and the end record.
- A descriptor is known by its signature, its length and sizes equal to the data counted since the header. A data
  record could look like one (16 bytes starting `PK\\7\\8` with those sizes), so a descriptor is held until the next
  write shows a local header or the central directory after it; otherwise it was data, and counted as data.
- The central directory and what follows are held to the end, each entry's crc32 put in, and each entry checked
  against what was counted (local header offset and size): anything torch did not write as described above is
  refused before the file is committed, rather than written with a wrong crc.

The files are byte for byte what torch.save writes with its own crc32 (the test compares them).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megatron_hpc.checkpoint.store.checksum import CAN_COMBINE, crc32, crc32_combine
from megatron_hpc.errors import CheckpointError

_LOCAL = b"PK\x03\x04"
_CENTRAL = b"PK\x01\x02"
_DESCRIPTOR = b"PK\x07\x08"
_CENTRAL_FIXED = struct.Struct("<4sHHHHHHIIIHHHHHII")  # 46 bytes (APPNOTE 4.3.12)
_ZIP64_EXTRA = 0x0001


Piece = tuple[memoryview | bytes, int | None]
"""Bytes to write, with their own crc32 where the filler took it (record data, with CAN_COMBINE): the sink then
combines it into the file's instead of reading the bytes again."""


class Filler:
    """Feed it every write of one torch.save in order; `feed` returns what to write now, `finish` the rest."""

    def __init__(self) -> None:
        self._offset = 0
        """Bytes fed so far (the file offset of the next write)."""
        self._header_left = 0
        self._header_buf = bytearray()
        self._in_data = False
        self._count = 0
        self._crc = 0
        self._held: bytes | None = None
        self._records: list[tuple[int, int, int]] = []
        """(local header offset, data size, crc32) of every record, in order."""
        self._record_at = 0
        self._tail: bytearray | None = None

    def feed(self, view: memoryview) -> list[Piece]:
        out: list[Piece] = []
        if not view.nbytes:  # nothing to count (and no sign of what comes next for a held descriptor)
            return out
        if self._tail is not None:
            self._tail += view
            return out
        if self._held is not None:
            held, self._held = self._held, None
            if bytes(view[:4]) in (_LOCAL, _CENTRAL):
                out.append((self._close_record(held), None))
            else:  # it looked like a descriptor but no header follows: it was data
                out.append((held, self._data(memoryview(held))))
        if self._in_data:
            if self._looks_like_descriptor(view):
                self._held = bytes(view)
                return out
            out.append((view, self._data(view)))
            return out
        if self._header_left == 0:
            head = bytes(view[:4])
            if head == _CENTRAL:
                self._tail = bytearray(view)
                return out
            if head != _LOCAL:
                raise CheckpointError(f"torch.save wrote {head!r} at byte {self._offset} where a zip record starts; "
                                      "this torch writes zips in a way our writer does not know (file_io.py)")
            self._record_at = self._offset
            self._header_left = -1  # the length is known once the fixed 30 bytes have arrived
            self._header_buf = bytearray()
        self._header(view)
        out.append((view, None))
        return out

    def _header(self, view: memoryview) -> None:
        """Counts the local header, its name and its extra field; the record's data starts after them."""
        n = view.nbytes
        if self._header_left < 0:
            need = 30 - len(self._header_buf)
            self._header_buf += view[:need]
            self._offset += min(n, need)
            if len(self._header_buf) < 30:
                return
            name_len, extra_len = struct.unpack_from("<HH", self._header_buf, 26)
            self._header_left = name_len + extra_len
            view, n = view[need:], n - need
        take = min(n, self._header_left)
        self._header_left -= take
        self._offset += take
        if self._header_left == 0:
            flags, crc, compressed = struct.unpack_from("<H6xII", self._header_buf, 6)
            if not flags & 0x08:  # no descriptor follows: torch writes an empty record so, its crc (0) in the header
                if compressed != 0 or crc != 0 or n > take:
                    raise CheckpointError(f"torch.save wrote a zip record at byte {self._record_at} with its sizes in "
                                          "the header; this torch writes zips in a way our writer does not know "
                                          "(file_io.py)")
                self._records.append((self._record_at, 0, 0))
                return
            self._in_data, self._count, self._crc = True, 0, 0
            if n > take:  # data in the same write as the header: not what torch does, but count it as data
                self._data(view[take:])

    def _data(self, view: memoryview) -> int | None:
        """Count record data; its own crc32 where it can be combined (else the record's running crc32 only)."""
        self._count += view.nbytes
        self._offset += view.nbytes
        if not CAN_COMBINE:
            self._crc = crc32(view, self._crc)
            return None
        own = crc32(view)
        self._crc = crc32_combine(self._crc, own, view.nbytes)
        return own

    def _looks_like_descriptor(self, view: memoryview) -> bool:
        if view.nbytes not in (16, 24) or bytes(view[:4]) != _DESCRIPTOR:
            return False
        fmt = "<II" if view.nbytes == 16 else "<QQ"
        compressed, size = struct.unpack_from(fmt, view, 8)
        return compressed == size == self._count

    def _close_record(self, descriptor: bytes) -> bytes:
        patched = bytearray(descriptor)
        struct.pack_into("<I", patched, 4, self._crc)
        self._records.append((self._record_at, self._count, self._crc))
        self._offset += len(patched)
        self._in_data = False
        return bytes(patched)

    def finish(self) -> bytes:
        """The central directory and end records with every entry's crc32 put in (torch.save has returned)."""
        if self._tail is None or self._held is not None or self._in_data or self._header_left:
            raise CheckpointError("torch.save's zip ended where a record was still open; this torch writes zips in a "
                                  "way our writer does not know (file_io.py)")
        tail = self._tail
        at, index = 0, 0
        while bytes(tail[at:at + 4]) == _CENTRAL:
            fields = _CENTRAL_FIXED.unpack_from(tail, at)
            compressed, size, name_len, extra_len, comment_len, header_at = (fields[8], fields[9], fields[10],
                                                                              fields[11], fields[12], fields[16])
            extra = bytes(tail[at + 46 + name_len:at + 46 + name_len + extra_len])
            size, compressed, header_at = _zip64(extra, size=size, compressed=compressed, header_at=header_at)
            if index >= len(self._records) or self._records[index][:2] != (header_at, size) or compressed != size:
                raise CheckpointError(f"torch.save's central directory entry {index} (record at byte {header_at}, "
                                      f"{compressed} bytes) is not the record counted there; this torch writes zips "
                                      "in a way our writer does not know (file_io.py)")
            struct.pack_into("<I", tail, at + 16, self._records[index][2])
            at += 46 + name_len + extra_len + comment_len
            index += 1
        if index != len(self._records):
            raise CheckpointError(f"torch.save wrote {len(self._records)} records but its central directory lists "
                                  f"{index}; this torch writes zips in a way our writer does not know (file_io.py)")
        self._tail = None
        return bytes(tail)


def _zip64(extra: bytes, *, size: int, compressed: int, header_at: int) -> tuple[int, int, int]:
    """The entry's size, compressed size and local header offset, from its zip64 extra field where the 32-bit fields
    say 0xFFFFFFFF (APPNOTE 4.5.3: the 64-bit values present appear in that order: size, compressed size, offset)."""
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, at)
        if tag == _ZIP64_EXTRA:
            values = iter(struct.unpack_from(f"<{length // 8}Q", extra, at + 4))
            if size == 0xFFFFFFFF:
                size = next(values)
            if compressed == 0xFFFFFFFF:
                compressed = next(values)
            if header_at == 0xFFFFFFFF:
                header_at = next(values)
            break
        at += 4 + length
    return size, compressed, header_at


_lock = threading.Lock()
_users = 0
_first_option = True
_option_per_thread: bool | None = None


def _per_thread() -> bool:
    """Whether torch keeps its serialization options per thread (recent releases: its config module's values are
    context variables) or one for the process (torch 2.9, the XLA tier's): asked of torch once, by setting the option
    on another thread and reading it here."""
    global _option_per_thread
    if _option_per_thread is None:
        before = torch.serialization.get_crc32_options()
        seen: list[bool] = []

        def flip() -> None:
            torch.serialization.set_crc32_options(not before)
            seen.append(torch.serialization.get_crc32_options())

        worker = threading.Thread(target=flip)
        worker.start()
        worker.join()
        _option_per_thread = torch.serialization.get_crc32_options() == before
        if not _option_per_thread:
            torch.serialization.set_crc32_options(before)
    return _option_per_thread


@contextmanager
def torch_crc_off() -> Iterator[None]:
    """torch.save does not compute record crc32s inside (the Filler does). torch reads the option when a save begins.
    Where torch keeps it per thread, each save sets it for its own thread and puts it back after. Where it is one for
    the process, saves on several threads share one switch: the first in turns it off and the last out puts it back
    (so a save never finds it turned back on by another thread's end, which would make its bytes depend on timing:
    torch's .data/serialization_id record is derived from the crc32s it computed)."""
    global _users, _first_option
    with _lock:
        per_thread = _per_thread()
        mine = torch.serialization.get_crc32_options()
        if per_thread:
            torch.serialization.set_crc32_options(False)
        elif _users == 0:
            _first_option = mine
            torch.serialization.set_crc32_options(False)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if per_thread:
                torch.serialization.set_crc32_options(mine)
            elif _users == 0:
                torch.serialization.set_crc32_options(_first_option)
