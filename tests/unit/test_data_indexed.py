"""The MMIDIDX reader/writer against the format table, written out by hand here.

Layout (shared/reference/megatron-and-launchers.md 1.2): magic b"MMIDIDX\\x00\\x00" | <Q version 1 |
<B dtype code | <Q N sequences | <Q M document indices | int32[N] lengths | int64[N] byte pointers |
int64[M] document indices. `.bin` is the tokens back to back. uint16 is code 8, int32 code 4.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from megatron_hpc.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from megatron_hpc.errors import DataError

# Two documents: [5, 6, 7] and [8, 9 | 10] (the second has two sequences).
DOCS = [([5, 6, 7], None), ([8, 9, 10], [2, 1])]


def _expected_idx(code: int, itemsize: int) -> bytes:
    lengths = [3, 2, 1]
    pointers = [0, 3 * itemsize, 5 * itemsize]
    docs = [0, 1, 3]
    return (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code) + struct.pack("<Q", 3)
            + struct.pack("<Q", 3) + struct.pack("<3i", *lengths) + struct.pack("<3q", *pointers)
            + struct.pack("<3q", *docs))


def _write(prefix: Path, dtype=np.uint16) -> Path:
    with IndexedDatasetWriter(prefix, dtype=dtype) as w:
        for tokens, lengths in DOCS:
            w.add_document(tokens, lengths)
    return prefix


@pytest.mark.parametrize(("dtype", "code", "fmt"), [(np.uint16, 8, "<6H"), (np.int32, 4, "<6i")])
def test_writer_bytes_match_the_format_table(tmp_path: Path, dtype, code: int, fmt: str) -> None:
    prefix = _write(tmp_path / "d", dtype)
    itemsize = np.dtype(dtype).itemsize
    assert (tmp_path / "d.idx").read_bytes() == _expected_idx(code, itemsize)
    assert (tmp_path / "d.bin").read_bytes() == struct.pack(fmt, 5, 6, 7, 8, 9, 10)
    ds = IndexedDataset(prefix)
    assert (len(ds), ds.num_documents, ds.num_tokens, ds.dtype) == (3, 2, 6, np.dtype(dtype))
    assert ds.sequence_lengths.tolist() == [3, 2, 1]
    assert ds.sequence_pointers.tolist() == [0, 3 * itemsize, 5 * itemsize]
    assert ds.document_indices.tolist() == [0, 1, 3]
    assert ds[1].tolist() == [8, 9] and ds.get(0, offset=1, length=2).tolist() == [6, 7]


def test_reads_a_hand_written_pair_with_unaligned_arrays(tmp_path: Path) -> None:
    # N=1, M=2: the int64 pointers start at byte 38, not a multiple of 8.
    idx = (b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 1, 2) + struct.pack("<i", 4)
           + struct.pack("<q", 0) + struct.pack("<2q", 0, 1))
    (tmp_path / "h.idx").write_bytes(idx)
    (tmp_path / "h.bin").write_bytes(struct.pack("<4H", 1, 2, 3, 65535))
    assert IndexedDataset(tmp_path / "h")[0].tolist() == [1, 2, 3, 65535]


def test_slices_are_views_of_the_mapped_bin(tmp_path: Path) -> None:
    ds = IndexedDataset(_write(tmp_path / "d"))
    view = ds.get(1, offset=0, length=2)
    assert not view.flags.owndata
    assert np.shares_memory(view, ds.get(1))
    assert isinstance(view.base, np.memmap) or isinstance(getattr(view.base, "base", None), np.memmap)


def test_merge_offsets_document_indices(tmp_path: Path) -> None:
    a = _write(tmp_path / "a")
    with IndexedDatasetWriter(tmp_path / "b", dtype=np.uint16) as w:
        w.add_document([1, 2])
    with IndexedDatasetWriter(tmp_path / "m", dtype=np.uint16) as w:
        w.add_index(a)
        w.add_index(tmp_path / "b")
    m = IndexedDataset(tmp_path / "m")
    assert m.document_indices.tolist() == [0, 1, 3, 4]
    assert m.sequence_lengths.tolist() == [3, 2, 1, 2]
    assert m[3].tolist() == [1, 2]
    assert (tmp_path / "m.bin").read_bytes() == (tmp_path / "a.bin").read_bytes() + (tmp_path / "b.bin").read_bytes()
    with IndexedDatasetWriter(tmp_path / "x", dtype=np.int32) as w, pytest.raises(DataError, match="cannot merge"):
        w.add_index(a)


def test_optimal_dtype_threshold() -> None:
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32


def _corrupt(tmp_path: Path, mutate) -> Path:
    prefix = _write(tmp_path / "c")
    idx = bytearray((tmp_path / "c.idx").read_bytes())
    binary = bytearray((tmp_path / "c.bin").read_bytes())
    idx, binary = mutate(idx, binary)
    (tmp_path / "c.idx").write_bytes(bytes(idx))
    if binary is None:
        (tmp_path / "c.bin").unlink()
    else:
        (tmp_path / "c.bin").write_bytes(bytes(binary))
    return prefix


def _set_pointer(idx: bytearray, i: int, value: int) -> bytearray:
    offset = 34 + 4 * 3 + 8 * i
    idx[offset:offset + 8] = struct.pack("<q", value)
    return idx


@pytest.mark.parametrize(("name", "mutate", "message", "suffix"), [
    ("truncated idx header", lambda i, b: (i[:20], b), "truncated: 20 bytes", ".idx"),
    ("truncated idx arrays", lambda i, b: (i[:-8], b), "truncated", ".idx"),
    ("idx too long", lambda i, b: (i + b"\x00", b), "longer than its header", ".idx"),
    ("truncated bin", lambda i, b: (i, b[:-2]), "truncated: 10 bytes", ".bin"),
    ("bin too long", lambda i, b: (i, b + b"\x00\x00"), "longer than its index", ".bin"),
    ("wrong magic", lambda i, b: (b"XXIDIDX\x00\x00" + i[9:], b), "wrong magic", ".idx"),
    ("legacy TNTIDX", lambda i, b: (b"TNTIDX\x00\x00" + i[8:], b), "TNTIDX", ".idx"),
    ("float code 6", lambda i, b: (i[:17] + b"\x06" + i[18:], b), "float", ".idx"),
    ("float code 7", lambda i, b: (i[:17] + b"\x07" + i[18:], b), "float", ".idx"),
    ("unknown code", lambda i, b: (i[:17] + b"\x09" + i[18:], b), "unknown dtype code 9", ".idx"),
    ("version 2", lambda i, b: (i[:9] + struct.pack("<Q", 2) + i[17:], b), "version 2", ".idx"),
    ("pointer disagrees", lambda i, b: (_set_pointer(i, 2, 8), b), "disagree at sequence 2", ".idx"),
    ("length disagrees", lambda i, b: (i[:34] + struct.pack("<i", 2) + i[38:], b), "disagree at sequence 1",
     ".idx"),
    ("missing bin", lambda i, b: (i, None), "not found", ".bin"),
])
def test_bad_inputs_are_data_errors_naming_the_file(tmp_path: Path, name: str, mutate, message: str,
                                                     suffix: str) -> None:
    prefix = _corrupt(tmp_path, mutate)
    with pytest.raises(DataError, match=message) as info:
        IndexedDataset(prefix)
    assert f"c{suffix}" in str(info.value), name


def test_missing_idx_names_it(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nothing\.idx not found"):
        IndexedDataset(tmp_path / "nothing")


def test_writer_rejects_lengths_that_do_not_add_up(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "w", dtype=np.uint16) as w, pytest.raises(DataError, match="add up"):
        w.add_document([1, 2, 3], [1, 1])
