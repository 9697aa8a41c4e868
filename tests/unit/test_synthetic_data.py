"""Synthetic tokens: a sample depends only on (seed, index); DP ranks read disjoint slices."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hpc.data.synthetic import SyntheticTokens
from megatron_hpc.plan.batch import BatchLayout


def test_sample_depends_only_on_seed_and_index() -> None:
    a = SyntheticTokens(vocab_size=500, seq_length=32, seed=1)
    b = SyntheticTokens(vocab_size=500, seq_length=32, seed=1)
    b.sample(99)  # reading other samples first changes nothing
    for i in (0, 5, 1234):
        np.testing.assert_array_equal(a.sample(i), b.sample(i))
    assert a.batch([3, 4]).shape == (2, 33)
    np.testing.assert_array_equal(a.batch([3, 4])[1].numpy(), a.sample(4))


def test_seed_and_index_change_the_data() -> None:
    a = SyntheticTokens(vocab_size=500, seq_length=32, seed=1)
    c = SyntheticTokens(vocab_size=500, seq_length=32, seed=2)
    assert any(not np.array_equal(a.sample(i), c.sample(i)) for i in range(8))
    assert len({a.sample(i).tobytes() for i in range(32)}) > 8


def test_tokens_follow_a_progression_within_vocab() -> None:
    data = SyntheticTokens(vocab_size=20, seq_length=64, seed=3)
    for i in range(10):
        tokens = data.sample(i)
        assert tokens.dtype == np.int64 and tokens.shape == (65,)
        assert tokens.min() >= 0 and tokens.max() < 20
        strides = np.unique((tokens[1:] - tokens[:-1]) % 20)
        assert len(strides) == 1


@pytest.mark.parametrize(("mbs", "gbs", "dp"), [(2, 8, 1), (2, 8, 2), (1, 8, 4), (4, 8, 2)])
def test_dp_ranks_partition_each_global_batch(mbs: int, gbs: int, dp: int) -> None:
    layout = BatchLayout(micro_batch_size=mbs, global_batch_size=gbs, num_micro_batches=gbs // (mbs * dp),
                         data_parallel=dp)
    for step in (0, 3):
        seen = [i for r in range(dp) for ids in layout.rank_indices(step, dp_rank=r) for i in ids]
        assert sorted(seen) == list(range(step * gbs, (step + 1) * gbs))  # disjoint and complete
