"""Typed facade over the C++ index builders (`megatron_hpc.data._helpers`), with a NumPy fallback.

The algorithms are Megatron's `megatron/core/datasets/helpers.cpp` (shared/reference/megatron-and-launchers.md
2.3, 2.5): the GPT sample index and the greedy blending index. The extension is built at install time from
`csrc/helpers.cpp` (setup.py); without it every function here still works, only slower (pure NumPy/Python
loops). Inputs are checked here, so the C++ code can index raw buffers without bounds checks.
"""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np

try:  # built by `pip install -e .`; absent in a bare checkout
    from megatron_hpc.data import _helpers as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None

INT32_MAX = np.iinfo(np.int32).max
MAX_DATASETS = 32767
"""Blending stores dataset ids as int16, as Megatron does."""


def native() -> ModuleType | None:
    """The compiled extension, or None when it was not built (the NumPy fallback is used then)."""
    return _native


def _require(array: np.ndarray, dtype: type[np.generic], name: str) -> np.ndarray:
    if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype != np.dtype(dtype):
        got = f"{array.dtype}, {array.ndim}-D" if isinstance(array, np.ndarray) else type(array).__name__
        raise TypeError(f"{name} must be a 1-D {np.dtype(dtype)} array, got {got}")
    return np.ascontiguousarray(array)


def sample_index_dtype(*, num_documents: int, max_sequence_length: int) -> np.dtype:
    """int32 when document-index positions and in-document offsets fit in it, else int64 (Megatron's helpers.py
    compares max(len(document_index), sizes.max()) with the int32 maximum)."""
    largest = max(num_documents, max_sequence_length)
    return np.dtype(np.int32) if largest <= INT32_MAX else np.dtype(np.int64)


def num_samples_in_index(*, num_epochs: int, tokens_per_epoch: int, seq_length: int,
                         drop_last_partial_sequence: bool, add_extra_token: int) -> int:
    """Samples build_sample_idx makes. The partial-sequence count uses a float32 division, like helpers.cpp."""
    total = num_epochs * tokens_per_epoch - add_extra_token
    if drop_last_partial_sequence:
        return total // seq_length
    return math.ceil(float(np.float32(total) / np.float32(seq_length)))


def _check_sample_args(sizes: np.ndarray, document_index: np.ndarray, *, seq_length: int, num_epochs: int,
                       tokens_per_epoch: int, add_extra_token: int) -> None:
    if seq_length <= 1 or num_epochs <= 0 or tokens_per_epoch <= 1 or add_extra_token not in (0, 1):
        raise ValueError(f"build_sample_idx needs seq_length > 1, num_epochs > 0, tokens_per_epoch > 1 and "
                         f"add_extra_token in (0, 1); got {seq_length}, {num_epochs}, {tokens_per_epoch}, "
                         f"{add_extra_token}")
    if len(document_index) == 0:
        raise ValueError("build_sample_idx needs a non-empty document index")
    low, high = int(document_index.min()), int(document_index.max())
    if low < 0 or high >= len(sizes):
        raise ValueError(f"document index values must lie in [0, {len(sizes)}), got [{low}, {high}]")


def build_sample_idx_numpy(sizes: np.ndarray, document_index: np.ndarray, *, seq_length: int, num_epochs: int,
                           tokens_per_epoch: int, drop_last_partial_sequence: bool, add_extra_token: int,
                           dtype: np.dtype) -> np.ndarray:
    """Pure-Python version of helpers.cpp build_sample_idx; same output, same dtype rule."""
    num_samples = num_samples_in_index(num_epochs=num_epochs, tokens_per_epoch=tokens_per_epoch,
                                       seq_length=seq_length, drop_last_partial_sequence=drop_last_partial_sequence,
                                       add_extra_token=add_extra_token)
    lengths = sizes.tolist()
    docs = document_index.tolist()
    out = np.zeros((num_samples + 1, 2), dtype=dtype)
    position, offset = 0, 0
    last = len(docs) - 1
    for sample in range(1, num_samples + 1):
        remaining = seq_length + add_extra_token
        while remaining != 0:
            length = lengths[docs[position]] - offset
            remaining -= length
            if remaining <= 0:
                # The last token of this sample is also the first of the next (add_extra_token).
                offset += remaining + length - add_extra_token
                remaining = 0
            elif position == last:
                if sample != num_samples:
                    raise ValueError(f"the document index holds fewer than tokens_per_epoch={tokens_per_epoch} "
                                     f"tokens per epoch; it ran out at sample {sample} of {num_samples}")
                offset = lengths[docs[last]] - add_extra_token
                break
            else:
                position += 1
                offset = 0
        out[sample] = (position, offset)
    return out


def build_sample_idx(sizes: np.ndarray, document_index: np.ndarray, *, seq_length: int, num_epochs: int,
                     tokens_per_epoch: int, drop_last_partial_sequence: bool = True,
                     add_extra_token: bool = True) -> np.ndarray:
    """The (num_samples + 1, 2) sample index: row k is (position in the document index, token offset) where
    sample k starts. int32 unless a position or a sequence length exceeds int32 (then int64), as Megatron picks.

    `sizes` are the dataset's int32 sequence lengths; `document_index` the int32 shuffled sequence ids.
    """
    sizes = _require(sizes, np.int32, "sizes")
    document_index = _require(document_index, np.int32, "document_index")
    extra = int(bool(add_extra_token))
    _check_sample_args(sizes, document_index, seq_length=seq_length, num_epochs=num_epochs,
                       tokens_per_epoch=tokens_per_epoch, add_extra_token=extra)
    dtype = sample_index_dtype(num_documents=len(document_index),
                               max_sequence_length=int(sizes.max()) if len(sizes) else 0)
    if _native is None:
        return build_sample_idx_numpy(sizes, document_index, seq_length=seq_length, num_epochs=num_epochs,
                                      tokens_per_epoch=tokens_per_epoch,
                                      drop_last_partial_sequence=drop_last_partial_sequence,
                                      add_extra_token=extra, dtype=dtype)
    build = _native.build_sample_idx_int32 if dtype == np.int32 else _native.build_sample_idx_int64
    return build(sizes, document_index, seq_length, num_epochs, tokens_per_epoch,
                 drop_last_partial_sequence, extra)


def _check_weights(weights: np.ndarray, name: str) -> None:
    if not 0 < len(weights) <= MAX_DATASETS:
        raise ValueError(f"{name} must hold 1 to {MAX_DATASETS} datasets, got {len(weights)}")
    if not np.all(np.isfinite(weights)) or np.any(weights <= 0):
        raise ValueError(f"{name} must be finite and positive, got {weights.tolist()}")


def build_blending_indices_numpy(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pure-Python version of helpers.cpp build_blending_indices."""
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    w = weights.tolist()
    counts = [0] * len(w)
    for i in range(size):
        scale = max(float(i), 1.0)
        best, best_error = 0, w[0] * scale - counts[0]
        for d in range(1, len(w)):
            error = w[d] * scale - counts[d]
            if error > best_error:  # strict: ties go to the lowest dataset id
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


def build_blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of length `size`: Megatron's deterministic greedy
    choice of the dataset furthest below its share `weights[d] * max(i, 1)` at each sample i."""
    weights = _require(weights, np.float64, "weights")
    _check_weights(weights, "weights")
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if _native is None:
        return build_blending_indices_numpy(weights, size)
    return _native.build_blending_indices(weights, size)


def build_exhaustive_blending_indices_numpy(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pure-Python version of helpers.cpp build_exhaustive_blending_indices."""
    total = int(sizes.sum())
    weights = [s / float(total) for s in sizes.tolist()]
    dataset_index = np.zeros(total, dtype=np.int16)
    dataset_sample_index = np.zeros(total, dtype=np.int64)
    counts = [0] * len(weights)
    unspent = list(range(len(weights)))
    for i in range(total):
        scale = max(float(i), 1.0)
        best, best_error = -1, -math.inf
        for d in unspent:  # ascending ids, like iterating Megatron's std::set
            error = weights[d] * scale - counts[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    return dataset_index, dataset_sample_index


def build_exhaustive_blending_indices(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Blend that draws exactly sizes[d] samples from dataset d (Megatron's choice when no size is given)."""
    sizes = _require(sizes, np.int64, "sizes")
    _check_weights(sizes, "sizes")
    if _native is None:
        return build_exhaustive_blending_indices_numpy(sizes)
    return _native.build_exhaustive_blending_indices(sizes)
