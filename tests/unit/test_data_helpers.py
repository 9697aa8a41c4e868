"""The C++ index builders against their NumPy versions, on random inputs, and the facade's checks."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hpc.data import helpers


def _native():
    ext = helpers.native()
    # Not a skip: the extension is built by `pip install -e .` (tests/run.sh); a missing one is a failure here.
    assert ext is not None, "megatron_hpc.data._helpers is not built; run pip install -e . --no-build-isolation"
    return ext


def _random_corpus(rng: np.random.Generator, *, max_len: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(sizes, shuffled document index over `epochs` epochs of a sequence range, epochs, tokens per epoch)."""
    sizes = rng.integers(1, max_len, size=int(rng.integers(5, 60))).astype(np.int32)
    documents = np.arange(int(rng.integers(0, 3)), len(sizes), dtype=np.int32)
    epochs = int(rng.integers(1, 4))
    index = np.tile(documents, epochs)
    rng.shuffle(index)
    return sizes, index, epochs, int(sizes[documents].sum())


@pytest.mark.parametrize("seed", range(25))
def test_sample_index_native_equals_numpy(seed: int) -> None:
    ext = _native()
    rng = np.random.default_rng(seed)
    sizes, index, epochs, tokens = _random_corpus(rng, max_len=int(rng.choice([3, 20, 200])))
    seq_length = int(rng.integers(2, 50))
    drop_last = bool(rng.integers(2))
    extra = int(rng.integers(2))
    args = dict(seq_length=seq_length, num_epochs=epochs, tokens_per_epoch=tokens,
                drop_last_partial_sequence=drop_last, add_extra_token=extra)
    expected = helpers.build_sample_idx_numpy(sizes, index, dtype=np.dtype(np.int64), **args)
    positional = (sizes, index, seq_length, epochs, tokens, drop_last, extra)
    got32 = ext.build_sample_idx_int32(*positional)
    got64 = ext.build_sample_idx_int64(*positional)
    assert got32.dtype == np.int32 and got64.dtype == np.int64
    np.testing.assert_array_equal(got32, expected)
    np.testing.assert_array_equal(got64, expected)
    # The facade picks int32 here and gives the same rows.
    facade = helpers.build_sample_idx(sizes, index, seq_length=seq_length, num_epochs=epochs, tokens_per_epoch=tokens,
                                      drop_last_partial_sequence=drop_last, add_extra_token=bool(extra))
    assert facade.dtype == np.int32
    np.testing.assert_array_equal(facade, expected)


def test_sample_index_is_contiguous_and_overlapping() -> None:
    """Every sample spans seq_length + 1 tokens of the flattened documents, sharing its last with the next."""
    sizes = np.array([5, 3, 9, 2, 7], dtype=np.int32)
    index = np.array([2, 0, 4, 1, 3], dtype=np.int32)
    out = helpers.build_sample_idx(sizes, index, seq_length=4, num_epochs=1, tokens_per_epoch=26)
    starts = np.concatenate(([0], np.cumsum(sizes[index])))
    flat = starts[out[:, 0]] + out[:, 1]
    assert out.shape == ((26 - 1) // 4 + 1, 2)
    np.testing.assert_array_equal(np.diff(flat), 4)


def test_dtype_rule_follows_megatron() -> None:
    assert helpers.sample_index_dtype(num_documents=10, max_sequence_length=2**31 - 1) == np.int32
    assert helpers.sample_index_dtype(num_documents=2**31, max_sequence_length=5) == np.int64
    assert helpers.sample_index_dtype(num_documents=3, max_sequence_length=2**31) == np.int64


def test_partial_sample_count_uses_float32_like_megatron() -> None:
    # (2**25 + 1) / 1 is not representable in float32, so the ceil gives 2**25, not 2**25 + 1.
    n = helpers.num_samples_in_index(num_epochs=1, tokens_per_epoch=2**25 + 2, seq_length=1,
                                     drop_last_partial_sequence=False, add_extra_token=1)
    assert n == 2**25
    assert helpers.num_samples_in_index(num_epochs=1, tokens_per_epoch=2**25 + 2, seq_length=1,
                                        drop_last_partial_sequence=True, add_extra_token=1) == 2**25 + 1


@pytest.mark.parametrize("seed", range(10))
def test_blending_native_equals_numpy(seed: int) -> None:
    ext = _native()
    rng = np.random.default_rng(seed)
    weights = rng.random(int(rng.integers(1, 8))) + 1e-3
    weights = weights / weights.sum()
    size = int(rng.integers(0, 3000))
    got = ext.build_blending_indices(weights, size)
    want = helpers.build_blending_indices_numpy(weights, size)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)
    sizes = rng.integers(1, 200, size=len(weights)).astype(np.int64)
    got = ext.build_exhaustive_blending_indices(sizes)
    want = helpers.build_exhaustive_blending_indices_numpy(sizes)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(np.bincount(got[0], minlength=len(sizes)), sizes)


def test_blending_is_greedy_with_ties_to_the_lowest_id() -> None:
    index, sample = helpers.build_blending_indices(np.array([0.5, 0.5]), 6)
    assert index.tolist() == [0, 1, 0, 1, 0, 1]
    assert sample.tolist() == [0, 0, 1, 1, 2, 2]
    index, _ = helpers.build_blending_indices(np.array([0.25, 0.75]), 8)
    assert np.bincount(index).tolist() == [2, 6]


def test_facade_checks_dtypes_and_values() -> None:
    sizes = np.array([4, 4], dtype=np.int32)
    with pytest.raises(TypeError, match="int32"):
        helpers.build_sample_idx(sizes.astype(np.int64), np.array([0, 1], dtype=np.int32), seq_length=2,
                                 num_epochs=1, tokens_per_epoch=8)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        helpers.build_sample_idx(sizes, np.array([0, 2], dtype=np.int32), seq_length=2, num_epochs=1,
                                 tokens_per_epoch=8)
    with pytest.raises(ValueError, match="seq_length > 1"):
        helpers.build_sample_idx(sizes, np.array([0, 1], dtype=np.int32), seq_length=1, num_epochs=1,
                                 tokens_per_epoch=8)
    with pytest.raises(ValueError, match="positive"):
        helpers.build_blending_indices(np.array([0.5, 0.0]), 4)
    with pytest.raises(TypeError, match="float64"):
        helpers.build_blending_indices(np.array([1, 1]), 4)


def test_extension_rejects_inconsistent_token_count() -> None:
    ext = _native()
    sizes = np.array([3, 3], dtype=np.int32)
    index = np.array([0, 1], dtype=np.int32)
    with pytest.raises(ValueError, match="fewer tokens"):  # std::invalid_argument -> ValueError
        ext.build_sample_idx_int32(sizes, index, 2, 1, 40, True, 1)
    with pytest.raises(ValueError, match="fewer than"):
        helpers.build_sample_idx_numpy(sizes, index, seq_length=2, num_epochs=1, tokens_per_epoch=40,
                                       drop_last_partial_sequence=True, add_extra_token=1, dtype=np.dtype(np.int32))


def test_fallback_is_used_without_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = np.array([5, 3, 9], dtype=np.int32)
    index = np.array([2, 0, 1], dtype=np.int32)
    with_ext = helpers.build_sample_idx(sizes, index, seq_length=3, num_epochs=1, tokens_per_epoch=17)
    monkeypatch.setattr(helpers, "_native", None)
    assert helpers.native() is None
    without = helpers.build_sample_idx(sizes, index, seq_length=3, num_epochs=1, tokens_per_epoch=17)
    assert without.dtype == with_ext.dtype
    np.testing.assert_array_equal(without, with_ext)
