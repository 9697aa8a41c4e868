"""Megatron's mmap indexed dataset (`MMIDIDX` v1): a zero-copy reader and a byte-exact writer.

Format (shared/reference/megatron-and-launchers.md 1.1-1.5): `.bin` is the token ids of every
sequence back to back, native little-endian, no header. `.idx` is a 34-byte header
(magic `MMIDIDX\\x00\\x00`, `<Q` version 1, `<B` dtype code, `<Q` sequence count N,
`<Q` document count M) followed, without padding, by int32[N] lengths, int64[N] byte pointers,
int64[M] document indices (sequence ids of document starts, `[0, ..., N]`) and, only for
multimodal datasets, int8[N] modes. The int64 arrays may start unaligned; numpy reads them as is.

Every inconsistency is a DataError naming the file, what was found, and what to do.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from megatron_hpc.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"TNTIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34
# Codes 6 and 7 (floats) swapped meaning in Megatron in 2023 (1.3); token data never uses them.
DTYPE_BY_CODE: dict[int, type[np.generic]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16,
}
CODE_BY_DTYPE = {np.dtype(t): c for c, t in DTYPE_BY_CODE.items()}
FLOAT_CODES = (6, 7)


def optimal_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits below 65500 (Megatron's DType.optimal_dtype), else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def data_file_paths(prefix: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(.idx, .bin) of a dataset prefix such as `my-gpt2_text_document`."""
    base = os.fspath(prefix)
    return Path(base + ".idx"), Path(base + ".bin")


class IndexedDataset:
    """Read-only view of a `.bin/.idx` pair; slices are views into the mmapped `.bin`."""

    def __init__(self, prefix: str | os.PathLike[str], *, multimodal: bool = False):
        self.prefix = os.fspath(prefix)
        self.idx_path, self.bin_path = data_file_paths(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise DataError(f"{path} not found; data.path (or --data-path) takes the prefix without .bin/.idx "
                                f"(e.g. my-gpt2_text_document), and both files must exist")
        self._idx = np.memmap(self.idx_path, dtype=np.uint8, mode="r") if self.idx_path.stat().st_size else None
        self._read_index(multimodal=multimodal)
        self._bin = (np.memmap(self.bin_path, dtype=self.dtype, mode="r")
                     if self.bin_path.stat().st_size else np.zeros(0, dtype=self.dtype))
        self._check_bin()

    def _fail(self, what: str, fix: str = "re-create it with `megatron-hpc data preprocess`") -> DataError:
        return DataError(f"{self.idx_path}: {what}; {fix}")

    def _read_index(self, *, multimodal: bool) -> None:
        raw = self._idx
        size = 0 if raw is None else len(raw)
        if size >= len(LEGACY_MAGIC) and bytes(raw[: len(LEGACY_MAGIC)]) == LEGACY_MAGIC:
            raise self._fail("is the legacy fairseq TNTIDX (lazy/cached) format, which megatron-hpc does not read",
                             "re-run Megatron's tools/preprocess_data.py (mmap output) or "
                             "`megatron-hpc data preprocess`")
        if size < HEADER_SIZE:
            raise self._fail(f"truncated: {size} bytes, shorter than the {HEADER_SIZE}-byte header")
        header = bytes(raw[:HEADER_SIZE])
        if header[:9] != MAGIC:
            raise self._fail(f"wrong magic {header[:9]!r} (expected {MAGIC!r}); not a Megatron .idx file")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            raise self._fail(f"index version {version}, only version {VERSION} exists")
        code = header[17]
        if code in FLOAT_CODES:
            raise self._fail(f"dtype code {code} is a float type (its meaning changed between Megatron versions); "
                             "token data must be uint16 (8) or int32 (4)")
        if code not in DTYPE_BY_CODE:
            raise self._fail(f"unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_BY_CODE[code])
        n, m = struct.unpack("<QQ", header[18:34])
        expected = HEADER_SIZE + 12 * n + 8 * m + (n if multimodal else 0)
        if size != expected:
            state = "truncated" if size < expected else "longer than its header says"
            raise self._fail(f"{state}: {size} bytes, but {n} sequences and {m} document indices need {expected}")
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(raw, dtype=np.int32, count=n, offset=offset)
        offset += 4 * n
        self.sequence_pointers = np.frombuffer(raw, dtype=np.int64, count=n, offset=offset)
        offset += 8 * n
        self.document_indices = np.frombuffer(raw, dtype=np.int64, count=m, offset=offset)
        offset += 8 * m
        self.sequence_modes = np.frombuffer(raw, dtype=np.int8, count=n, offset=offset) if multimodal else None
        self._check_index(n, m)

    def _check_index(self, n: int, m: int) -> None:
        if m == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != n:
            first_last = (self.document_indices[0], self.document_indices[-1]) if m else "none"
            raise self._fail(f"document indices must run from 0 to the {n} sequences, found {first_last}")
        if m > 1 and np.any(np.diff(self.document_indices) < 0):
            raise self._fail("document indices are not increasing")
        if n and np.any(self.sequence_lengths < 0):
            raise self._fail("negative sequence lengths")
        if n:
            starts = np.zeros(n, dtype=np.int64)
            np.cumsum(self.sequence_lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=starts[1:])
            bad = np.flatnonzero(starts != self.sequence_pointers)
            if bad.size:
                i = int(bad[0])
                raise self._fail(f"lengths and pointers disagree at sequence {i}: pointer "
                                 f"{int(self.sequence_pointers[i])}, lengths imply {int(starts[i])}")

    def _check_bin(self) -> None:
        need = self.num_tokens * self.dtype.itemsize
        have = self.bin_path.stat().st_size
        if have != need:
            state = "truncated" if have < need else "longer than its index says"
            raise DataError(f"{self.bin_path}: {state}: {have} bytes, the index describes {need} "
                            f"({self.num_tokens} tokens of {self.dtype}); re-create the pair with "
                            "`megatron-hpc data preprocess`")

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `index`: a view, no copy."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} out of range for {len(self)} sequences")
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return self._bin[start:start + length]


class IndexedDatasetWriter:
    """Write a `.bin/.idx` pair byte for byte as Megatron's IndexedDatasetBuilder does.

    Files are written under temporary names and renamed into place by `finalize`, so a reader
    never sees a half-written dataset.
    """

    def __init__(self, prefix: str | os.PathLike[str], *, dtype: np.dtype | type[np.generic]):
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_BY_DTYPE:
            raise DataError(f"cannot write tokens as {self.dtype}; use uint16 or int32")
        self.idx_path, self.bin_path = data_file_paths(prefix)
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + ".tmp")
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115  (closed by finalize)
        # Chunks, one per add_* call, concatenated by finalize: no Python int per sequence.
        self._lengths: list[np.ndarray] = []
        self._document_ends: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self.num_sequences = 0

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Iterable[int] | None = None) -> None:
        """One document; `lengths` splits it into sequences (sentences), default one sequence."""
        array = np.asarray(tokens, dtype=self.dtype)
        parts = [len(array)] if lengths is None else [int(x) for x in lengths]
        if sum(parts) != len(array):
            raise DataError(f"sequence lengths {parts} do not add up to the document's {len(array)} tokens")
        self.add_documents(array, parts, sequences_per_document=[len(parts)])

    def add_documents(self, tokens: Sequence[int] | np.ndarray, sequence_lengths: Sequence[int] | np.ndarray, *,
                      sequences_per_document: Sequence[int] | np.ndarray) -> None:
        """Many documents at once: their tokens back to back, the length of every sequence, and the number of
        sequences of every document (0 for an empty document)."""
        array = np.asarray(tokens, dtype=self.dtype)
        lengths = np.asarray(sequence_lengths, dtype=np.int32)
        counts = np.asarray(sequences_per_document, dtype=np.int64)
        total = int(lengths.sum(dtype=np.int64))
        if total != len(array):
            raise DataError(f"sequence lengths add up to {total}, not to the {len(array)} tokens given")
        if int(counts.sum()) != len(lengths):
            raise DataError(f"documents of {int(counts.sum())} sequences in all, but {len(lengths)} sequence "
                            "lengths were given")
        self._bin.write(np.ascontiguousarray(array).data)
        self._lengths.append(lengths)
        self._document_ends.append(self.num_sequences + np.cumsum(counts))
        self.num_sequences += len(lengths)

    def add_index(self, prefix: str | os.PathLike[str]) -> None:
        """Append another dataset (merge); its dtype must match."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise DataError(f"cannot merge {other.prefix} ({other.dtype}) into a {self.dtype} dataset")
        self._lengths.append(np.array(other.sequence_lengths, dtype=np.int32))
        self._document_ends.append(other.document_indices[1:].astype(np.int64) + self.num_sequences)
        self.num_sequences += len(other)
        with open(other.bin_path, "rb") as src:
            shutil.copyfileobj(src, self._bin)

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int32)
        document_indices = np.concatenate(self._document_ends)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths):
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        idx_tmp = self.idx_path.with_name(self.idx_path.name + ".tmp")
        with open(idx_tmp, "wb") as out:
            out.write(MAGIC)
            out.write(struct.pack("<Q", VERSION))
            out.write(struct.pack("<B", CODE_BY_DTYPE[self.dtype]))
            out.write(struct.pack("<Q", len(lengths)))
            out.write(struct.pack("<Q", len(document_indices)))
            out.write(lengths.tobytes(order="C"))
            out.write(pointers.tobytes(order="C"))
            out.write(document_indices.tobytes(order="C"))
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(idx_tmp, self.idx_path)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self._bin.close()
            self._bin_tmp.unlink(missing_ok=True)
